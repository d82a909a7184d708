"""Pure: one map as typed Envoy xDS resources, for the gRPC transport in adapters.envoy.xds.

Owns the shape of what the sidecar sends Envoy over delta ADS: per map, one cluster
`ome|<ns>|<name>` holding each backend of non-zero weight as a locality of that weight (named after
the backend, so the load reports count per backend), a ScopedRouteConfiguration keyed on the
hostname and a RouteConfiguration of the same name routing `/` to that cluster (or a 503), each
serialized once, deterministically, with a version that is a digest of its bytes. One cluster per
map, not per backend: Envoy holds ~20 KB per cluster whatever its stats, so 10,000 maps of 4
backends took 0.9 GB as 40,000 clusters. No I/O, no state.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2, scoped_route_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, tls_pb2
from envoy.type.matcher.v3 import string_pb2
from google.protobuf import any_pb2

from adapters.base import envoy_weight_sum_problem, publication_problem
from adapters.envoy.names import map_cluster_name
from adapters.timeouts import DEFAULT_ROUTE_IDLE_TIMEOUT, DEFAULT_ROUTE_TIMEOUT
from publisher.core.addresses import is_canonical_ipv4, parse_endpoint
from publisher.core.values import Backend, MapKey, Publication, Route

__all__ = [
    "CLUSTER_TYPE",
    "ROUTE_TYPE",
    "SCOPE_TYPE",
    "MapResources",
    "Resource",
    "XdsRenderer",
    "key_of",
    "map_name",
    "route_from_version",
    "served_route",
]

CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ROUTE_TYPE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
SCOPE_TYPE = "type.googleapis.com/envoy.config.route.v3.ScopedRouteConfiguration"
_DEFAULT_CA = Path("/etc/ssl/certs/ca-certificates.crt")


def map_name(key: MapKey) -> str:
    """The name of a map's scope, of its route configuration and of its cluster."""
    return map_cluster_name(key)


def key_of(name: str) -> MapKey | None:
    """The map a resource name written by this module belongs to, or None for a foreign one."""
    parts = name.split("|")
    if len(parts) in (3, 4) and parts[0] == "ome":
        return MapKey(parts[1], parts[2])
    return None


@dataclass(frozen=True, slots=True)
class Resource:
    """One xDS resource as sent: its name, its version (a digest of `body`) and its serialized message."""

    name: str
    version: str
    body: bytes

    def packed(self, type_url: str) -> any_pb2.Any:
        return any_pb2.Any(type_url=type_url, value=self.body)


@dataclass(frozen=True, eq=False)
class MapResources:
    """One map's part: equal exactly when Envoy would serve the same (the resources' bytes). Its
    clusters and route configuration, nearly all of rendering, are built when first asked for:
    a first publish builds each batch of them while Envoy is still applying the batch before."""

    key: MapKey
    route: Route
    scope: Resource
    ca_file: Path
    rewrite_host: bool
    timeout: float = DEFAULT_ROUTE_TIMEOUT
    idle_timeout: float = DEFAULT_ROUTE_IDLE_TIMEOUT

    @functools.cached_property
    def clusters(self) -> tuple[Resource, ...]:
        """The map's one cluster; none when no backend may serve (the route answers 503). Its
        version names the route: a weight change is this cluster alone, and its ACK confirms it."""
        if self.route.all_zero:
            return ()
        cluster = _resource(map_name(self.key), _cluster(map_name(self.key), self.route, self.ca_file, self.rewrite_host))
        return (Resource(cluster.name, _route_version(self.route, cluster.body), cluster.body),)

    @functools.cached_property
    def route_config(self) -> Resource:
        """Routes to the map's cluster, the same whatever the weights; a 503 has no cluster, so its
        version names the route."""
        config = _resource(map_name(self.key), _route_config(self.key, self.route, self.rewrite_host, self.timeout, self.idle_timeout))
        if self.route.all_zero:
            return Resource(config.name, _route_version(self.route, config.body), config.body)
        return config

    @property
    def version(self) -> str:
        """The version that names the route Envoy serves for this map (see `served_route`)."""
        return (self.clusters[0] if self.clusters else self.route_config).version

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MapResources):
            return NotImplemented
        return (self.route_config, self.scope) == (other.route_config, other.scope) and self.clusters == other.clusters

    __hash__ = None  # type: ignore[assignment]  # equal by bytes, built lazily: not a dict key


def _digest(body: bytes) -> str:
    return hashlib.blake2b(body, digest_size=10).hexdigest()


def _resource(name: str, message: object) -> Resource:
    body = message.SerializeToString(deterministic=True)  # type: ignore[attr-defined]
    return Resource(name, _digest(body), body)


def _route_version(route: Route, body: bytes) -> str:
    """The version of the resource that names the route (the map's cluster, or its route
    configuration for a 503): its digest, then the route itself, so a restarted sidecar learns from
    the versions Envoy lists on reconnect what each Envoy serves for each map."""
    backends = [[b.cluster, b.endpoint, b.weight] for b in route.backends]
    return f"{_digest(body)} {json.dumps([route.hostname, backends], separators=(',', ':'))}"


def served_route(cluster_version: str | None, route_version: str | None) -> Route | None:
    """The route an Envoy serves for a map whose scope it holds, from the versions it holds of the
    map's cluster and route configuration: a 503 is named by the route configuration, any other
    route by the cluster it routes to. None: not served (a route configuration naming a route with
    backends is an older sidecar's, of a cluster per backend)."""
    if route_version is None:
        return None
    named = route_from_version(route_version)
    if named is not None:
        return named if named.all_zero else None
    return route_from_version(cluster_version) if cluster_version is not None else None


# Every resync reads what each Envoy holds: nearly every version is one read before, so its Route
# is kept (Routes are immutable) rather than parsed again. Room for 10,000 maps on a few Envoys.
@functools.lru_cache(maxsize=1 << 15)
def route_from_version(version: str) -> Route | None:
    """The Route a route configuration version written by this module names, or None."""
    _, _, text = version.partition(" ")
    try:
        hostname, backends = json.loads(text)
        return Route(hostname, tuple(Backend(str(c), str(e), int(w)) for c, e, w in backends))
    except (ValueError, TypeError):
        return None


def _ip_literal(host: str) -> str | None:
    # Only a host starting with a digit or '[' can be an IP literal: the others skip the parse.
    if not host[:1].isdigit() and not host.startswith("["):
        return None
    if is_canonical_ipv4(host):
        return host
    bare = host[1:-1] if host.startswith("[") else host
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        return None


_SOCKET_MATCH = "envoy.transport_socket_match"


def _cluster(name: str, route: Route, ca_file: Path, rewrite_host: bool) -> cluster_pb2.Cluster:
    """One cluster for the map: each backend of non-zero weight is a locality of that weight
    (locality-weighted load balancing: Envoy picks a locality by weight, then a host in it), named
    after the backend so the load reports count per backend. All IP backends make a STATIC cluster;
    any name makes it STRICT_DNS (each address a name resolves to is a host of its locality)."""
    serving = [(b, parse_endpoint(b.endpoint)) for b in route.backends if b.weight > 0]
    ips = [_ip_literal(endpoint.host) for _, endpoint in serving]
    static = all(ips)
    cluster = cluster_pb2.Cluster(name=name, type=cluster_pb2.Cluster.STATIC if static else cluster_pb2.Cluster.STRICT_DNS)
    cluster.connect_timeout.seconds = 5
    cluster.common_lb_config.locality_weighted_lb_config.SetInParent()
    cluster.load_assignment.cluster_name = name
    if not static:
        cluster.dns_lookup_family = cluster_pb2.Cluster.V4_PREFERRED
    for (backend, endpoint), ip in zip(serving, ips):
        locality = cluster.load_assignment.endpoints.add()
        locality.locality.sub_zone = backend.cluster
        locality.load_balancing_weight.value = backend.weight
        lb_endpoint = locality.lb_endpoints.add()
        lb_endpoint.endpoint.address.socket_address.address = ip or endpoint.host
        lb_endpoint.endpoint.address.socket_address.port_value = endpoint.port
        if rewrite_host:  # the route's auto_host_rewrite sends this as the Host header
            lb_endpoint.endpoint.hostname = endpoint.host[1:-1] if endpoint.host.startswith("[") else endpoint.host
        if endpoint.tls:
            # Each TLS backend's own SNI and name check: its endpoint picks its transport socket.
            lb_endpoint.metadata.filter_metadata[_SOCKET_MATCH].fields["backend"].string_value = backend.cluster
            match = cluster.transport_socket_matches.add(name=backend.cluster)
            match.match.fields["backend"].string_value = backend.cluster
            match.transport_socket.name = "envoy.transport_sockets.tls"
            match.transport_socket.typed_config.Pack(_tls(endpoint.host, ip, ca_file))
    return cluster


def _tls(host: str, ip: str | None, ca_file: Path) -> tls_pb2.UpstreamTlsContext:
    validation = common_pb2.CertificateValidationContext(trusted_ca=base_pb2.DataSource(filename=str(ca_file)))
    if not ip:
        validation.match_typed_subject_alt_names.append(
            common_pb2.SubjectAltNameMatcher(san_type=common_pb2.SubjectAltNameMatcher.DNS, matcher=string_pb2.StringMatcher(exact=host))
        )
    return tls_pb2.UpstreamTlsContext(common_tls_context=tls_pb2.CommonTlsContext(validation_context=validation), sni="" if ip else host)


def _route_config(key: MapKey, route: Route, rewrite_host: bool, timeout: float, idle_timeout: float) -> route_pb2.RouteConfiguration:
    rule = route_components_pb2.Route(match=route_components_pb2.RouteMatch(prefix="/"))
    if route.all_zero:
        rule.direct_response.status = 503
    else:
        # The weights are the cluster's localities; the host rewrite is each endpoint's hostname.
        rule.route.cluster = map_name(key)
        if rewrite_host:
            rule.route.auto_host_rewrite.value = True
        # adapters.timeouts: 0s is no deadline (Envoy's default is 15 s for the whole answer); the
        # idle timeout replaces the connection manager's stream idle timeout (5 min).
        rule.route.timeout.FromMilliseconds(round(timeout * 1000))
        rule.route.idle_timeout.FromMilliseconds(round(idle_timeout * 1000))
    # The scope picked this configuration by host already, so its one virtual host takes any.
    virtual_host = route_components_pb2.VirtualHost(name=map_name(key), domains=["*"], routes=[rule])
    return route_pb2.RouteConfiguration(name=map_name(key), virtual_hosts=[virtual_host])


def _scope(key: MapKey, hostname: str) -> scoped_route_pb2.ScopedRouteConfiguration:
    scope = scoped_route_pb2.ScopedRouteConfiguration(name=map_name(key), route_configuration_name=map_name(key))
    scope.key.fragments.add(string_key=hostname)
    return scope


@dataclass(frozen=True)
class XdsRenderer:
    """The Renderer of Envoy's xDS mode (adapters.base.Renderer[MapResources])."""

    ca_file: Path = _DEFAULT_CA
    rewrite_host: bool = False
    timeout: float = DEFAULT_ROUTE_TIMEOUT
    idle_timeout: float = DEFAULT_ROUTE_IDLE_TIMEOUT

    def problem(self, key: MapKey, route: Route) -> str | None:
        probe = Publication(key.namespace, key.name, route.hostname, 0, 0, route.backends)
        problem = publication_problem(probe)
        if problem is not None:
            return problem
        if route.hostname.startswith("*."):
            return f"hostname {route.hostname!r}: Envoy's scoped routes match one exact host, not a wildcard"
        weights = envoy_weight_sum_problem(route)
        if weights is not None:
            return weights
        for backend in route.backends:
            endpoint = parse_endpoint(backend.endpoint)
            if endpoint.path not in ("", "/"):
                return f"backends[{backend.cluster}].endpoint has path {endpoint.path!r}; Envoy cannot rewrite the path per backend (a backend is a locality of the map's cluster)"
            if endpoint.host.startswith("[") and _ip_literal(endpoint.host) is None:
                return f"backends[{backend.cluster}].endpoint host {endpoint.host!r} is not an IPv6 address"
        return None

    def render(self, key: MapKey, route: Route) -> MapResources:
        scope = _resource(map_name(key), _scope(key, route.hostname))
        return MapResources(key, route, scope, self.ca_file, self.rewrite_host, self.timeout, self.idle_timeout)
