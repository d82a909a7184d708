"""Pure: Envoy file mode's renderer and read-back. A map's Route becomes its clusters and virtual
host (`weighted_clusters` on `/`; no generation: a generation-only change renders the same part),
the parts join into the two xDS DiscoveryResponses Envoy watches (`cds.yaml`, `rds.yaml`: JSON,
valid YAML) whose `version_info` digests the content, and those documents parse back into routes.

Owns no state and does no I/O. Imports the standard library, yaml, adapters.base's checks,
adapters.route_json, adapters.timeouts, publisher.core.values and .addresses and, in this package, names and options.
The transport writing the files is adapters.envoy.files.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from adapters.base import duplicate_hostname, envoy_weight_sum_problem, publication_problem
from adapters.envoy.names import cluster_name
from adapters.envoy.options import EnvoyOptions
from adapters.route_json import from_json as route_from_json
from adapters.route_json import to_json as route_json
from adapters.timeouts import DEFAULT_ROUTE_IDLE_TIMEOUT, DEFAULT_ROUTE_TIMEOUT, envoy_duration
from publisher.core.addresses import parse_endpoint
from publisher.core.values import MapKey, Publication, Route

__all__ = [
    "CDS_FILE",
    "RDS_FILE",
    "ClusterText",
    "EnvoyPart",
    "EnvoyRenderer",
    "Rendered",
    "assemble",
    "cds_document",
    "envoy_problem",
    "ip_literal",
    "read_clusters",
    "read_routes",
    "render",
    "render_part",
    "route_problem",
    "route_timeouts",
    "shared_problem",
]

CDS_FILE = "cds.yaml"
RDS_FILE = "rds.yaml"
METADATA_KEY = "ome-gateway-publisher"
_CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
_ROUTE_TYPE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
_TLS_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"

_DEFAULT_CA: Path = EnvoyOptions.model_fields["envoy_ca_file"].default




def _virtual_host_name(key: MapKey) -> str:
    return f"ome|{key.namespace}|{key.name}"


def shared_problem(key: MapKey, route: Route) -> str | None:
    """The strict checks every adapter shares (adapters.base.publication_problem), for a Route."""
    return publication_problem(Publication(key.namespace, key.name, route.hostname, 0, 0, route.backends))


def envoy_problem(route: Route) -> str | None:
    """What Envoy cannot be given about a route that passed the shared checks, or None."""
    weights = envoy_weight_sum_problem(route)
    if weights is not None:
        return weights
    for backend in route.backends:
        endpoint = parse_endpoint(backend.endpoint)
        if endpoint.path not in ("", "/"):
            return f"backends[{backend.cluster}].endpoint has path {endpoint.path!r}; Envoy weighted_clusters cannot rewrite the path per backend"
        if endpoint.host.startswith("["):
            try:
                ipaddress.IPv6Address(endpoint.host[1:-1])
            except ValueError:
                return f"backends[{backend.cluster}].endpoint host {endpoint.host!r} is not an IPv6 address"
    return None


def route_problem(key: MapKey, route: Route) -> str | None:
    """Why a route must not reach Envoy's config, or None: every value that reaches it, checked."""
    return shared_problem(key, route) or envoy_problem(route)


def ip_literal(host: str) -> str | None:
    bare = host[1:-1] if host.startswith("[") else host
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        return None


def _cluster(key: MapKey, cluster: str, endpoint_url: str, *, ca_file: Path) -> dict[str, Any]:
    endpoint = parse_endpoint(endpoint_url)
    ip = ip_literal(endpoint.host)
    resource: dict[str, Any] = {
        "@type": _CLUSTER_TYPE,
        "name": cluster_name(key, cluster),
        # An IP needs no resolver; a name is one logical host, re-resolved per connection, as for any
        # external service behind a load balancer (the shape of OME's ExternalName Services).
        "type": "STATIC" if ip else "LOGICAL_DNS",
        "connect_timeout": "5s",
        "load_assignment": {
            "cluster_name": cluster_name(key, cluster),
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": {"socket_address": {"address": ip or endpoint.host, "port_value": endpoint.port}}}}
                    ]
                }
            ],
        },
    }
    if not ip:
        resource["dns_lookup_family"] = "V4_PREFERRED"
    if endpoint.tls:
        tls: dict[str, Any] = {
            "@type": _TLS_TYPE,
            "common_tls_context": {"validation_context": {"trusted_ca": {"filename": str(ca_file)}}},
        }
        if not ip:
            tls["sni"] = endpoint.host
            tls["common_tls_context"]["validation_context"]["match_typed_subject_alt_names"] = [
                {"san_type": "DNS", "matcher": {"exact": endpoint.host}}
            ]
        resource["transport_socket"] = {"name": "envoy.transport_sockets.tls", "typed_config": tls}
    return resource


def _virtual_host(key: MapKey, route: Route, *, rewrite_host: bool, timeout: float, idle_timeout: float) -> dict[str, Any]:
    envoy_route: dict[str, Any] = {
        "match": {"prefix": "/"},
        "metadata": {"filter_metadata": {METADATA_KEY: route_json(key, route)}},
    }
    if route.all_zero:
        envoy_route["direct_response"] = {"status": 503}
    else:
        clusters = []
        for backend in route.backends:
            weight: dict[str, Any] = {"name": cluster_name(key, backend.cluster), "weight": backend.weight}
            if rewrite_host:
                host = parse_endpoint(backend.endpoint).host
                weight["host_rewrite_literal"] = host[1:-1] if host.startswith("[") else host
            clusters.append(weight)
        envoy_route["route"] = {"weighted_clusters": {"clusters": clusters}, **route_timeouts(timeout, idle_timeout)}
    return {"name": _virtual_host_name(key), "domains": [route.hostname], "routes": [envoy_route]}


def route_timeouts(timeout: float, idle_timeout: float) -> dict[str, str]:
    """A route action's timeouts (adapters.timeouts): `timeout` 0s is no deadline, where Envoy's
    default is 15 s for the whole answer; `idle_timeout` replaces the connection manager's stream
    idle timeout (5 min) once the route is chosen."""
    return {"timeout": envoy_duration(timeout), "idle_timeout": envoy_duration(idle_timeout)}


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


ClusterText = tuple[str, str, bytes]  # (name, JSON text, digest)


@dataclass(frozen=True, slots=True)
class EnvoyPart:
    """One map's share of both files, rendered once: JSON text (which is YAML, and which json.loads
    reads back far faster than a YAML parser). Equal parts are served the same."""

    hostname: str
    virtual_host: str
    virtual_host_digest: bytes = field(compare=False)
    clusters: tuple[ClusterText, ...]  # in backend order


def render_part(
    key: MapKey,
    route: Route,
    *,
    rewrite_host: bool = False,
    ca_file: Path = _DEFAULT_CA,
    timeout: float = DEFAULT_ROUTE_TIMEOUT,
    idle_timeout: float = DEFAULT_ROUTE_IDLE_TIMEOUT,
) -> EnvoyPart:
    """Both files' text for one map. ValueError for a route `route_problem()` refuses."""
    problem = route_problem(key, route)
    if problem is not None:
        raise ValueError(f"{key}: {problem}")
    virtual_host = _dumps(_virtual_host(key, route, rewrite_host=rewrite_host, timeout=timeout, idle_timeout=idle_timeout))
    clusters = []
    for backend in route.backends:
        text = _dumps(_cluster(key, backend.cluster, backend.endpoint, ca_file=ca_file))
        clusters.append((cluster_name(key, backend.cluster), text, _digest(text)))
    return EnvoyPart(route.hostname, virtual_host, _digest(virtual_host), tuple(clusters))


@dataclass(frozen=True)
class EnvoyRenderer:
    """The `Renderer` of file mode (and of the parts xDS mode does not need). Pure."""

    rewrite_host: bool = False
    ca_file: Path = _DEFAULT_CA
    timeout: float = DEFAULT_ROUTE_TIMEOUT
    idle_timeout: float = DEFAULT_ROUTE_IDLE_TIMEOUT

    def problem(self, key: MapKey, route: Route) -> str | None:
        return envoy_problem(route)

    def render(self, key: MapKey, route: Route) -> EnvoyPart:
        return render_part(
            key, route, rewrite_host=self.rewrite_host, ca_file=self.ca_file, timeout=self.timeout, idle_timeout=self.idle_timeout
        )


def _version(digests: Iterable[bytes]) -> str:
    h = hashlib.blake2b(digest_size=12)
    for d in digests:
        h.update(d)
    return h.hexdigest()


def cds_document(clusters: list[ClusterText]) -> tuple[str, str]:
    version = _version(d for _, _, d in clusters)
    body = ",".join(text for _, text, _ in clusters)
    return version, f'{{"version_info":"{version}","resources":[{body}]}}\n'


@dataclass(frozen=True)
class Rendered:
    """Both files for a set of parts, with their versions and the clusters in cds order."""

    cds: str
    rds: str
    cds_version: str
    rds_version: str
    clusters: list[ClusterText] = field(repr=False)


def assemble(parts: Mapping[MapKey, EnvoyPart], *, route_config: str = "ome-global") -> Rendered:
    """Pure: cds.yaml and rds.yaml from the parts, in key order; each version a digest of the part
    digests. ValueError for two maps with one domain. A join of cached texts: cheap at 10,000 maps."""
    duplicate = duplicate_hostname(parts, "domain")
    if duplicate is not None:
        raise ValueError(duplicate)
    order = sorted(parts)
    rds_version = _version([route_config.encode(), *(parts[k].virtual_host_digest for k in order)])
    hosts = ",".join(parts[k].virtual_host for k in order)
    rds = (
        f'{{"version_info":"{rds_version}","resources":[{{"@type":"{_ROUTE_TYPE}",'
        f'"name":"{route_config}","virtual_hosts":[{hosts}]}}]}}\n'
    )
    clusters = [c for k in order for c in parts[k].clusters]
    cds_version, cds = cds_document(clusters)
    return Rendered(cds, rds, cds_version, rds_version, clusters)


def render(
    routes: Mapping[MapKey, Route],
    *,
    route_config: str = "ome-global",
    rewrite_host: bool = False,
    ca_file: Path = _DEFAULT_CA,
    timeout: float = DEFAULT_ROUTE_TIMEOUT,
    idle_timeout: float = DEFAULT_ROUTE_IDLE_TIMEOUT,
) -> Rendered:
    """Pure: routes -> cds.yaml and rds.yaml. ValueError for a route Envoy cannot take, or two maps
    with one hostname."""
    renderer = EnvoyRenderer(rewrite_host=rewrite_host, ca_file=ca_file, timeout=timeout, idle_timeout=idle_timeout)
    return assemble({key: renderer.render(key, route) for key, route in routes.items()}, route_config=route_config)


_DECODER = json.JSONDecoder()
_RDS_HEAD = re.compile(r'\{"version_info":"[0-9a-f]*","resources":\[\{"@type":"[^"]*","name":"[^"]*","virtual_hosts":\[')
_CDS_HEAD = re.compile(r'\{"version_info":"[0-9a-f]*","resources":\[')


def _elements(text: str, start: int) -> Iterator[tuple[Any, int, int]]:
    """Each element of the JSON array whose first element is at `start`: (value, begin, end).

    One short parse per element, not one for the whole file: a thread reading a large file this
    way gives the event loop's thread the GIL between elements."""
    position, end = start, len(text)
    while position < end and text[position] != "]":
        value, stop = _DECODER.raw_decode(text, position)
        yield value, position, stop
        position = stop + 1 if stop < end and text[stop] == "," else stop
    if position >= end:
        raise ValueError("unterminated array")


def _load(text: str) -> Any:
    # Any file not in the shape `assemble` writes: JSON, else YAML through the C loader when built.
    try:
        return json.loads(text)
    except ValueError:
        return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _metadata_route(virtual_host: Any) -> tuple[MapKey, Route]:
    return route_from_json(virtual_host["routes"][0]["metadata"]["filter_metadata"][METADATA_KEY])


def _served_with(virtual_host: Any, timeouts: Mapping[str, str] | None) -> bool:
    """Whether the host's route has `timeouts` (route_timeouts), or answers without a backend."""
    action = virtual_host["routes"][0].get("route")
    return timeouts is None or action is None or all(action.get(name) == value for name, value in timeouts.items())


def read_routes(rds_text: str, *, timeouts: Mapping[str, str] | None = None) -> tuple[str, dict[MapKey, Route]]:
    """Pure: the version and the routes an rds.yaml written by `assemble` holds. ValueError else.
    With `timeouts` (route_timeouts), a route served with others (an older sidecar's, or other
    options) is left out: to the engine it is not served, and it is written again. Blocking for a
    large file: call it through asyncio.to_thread."""
    try:
        head = _RDS_HEAD.match(rds_text)
        if head is not None:
            version = json.loads(rds_text[: rds_text.index(',"resources"')] + "}")["version_info"]
            hosts = (host for host, _, _ in _elements(rds_text, head.end()))
            return str(version), dict(_metadata_route(host) for host in hosts if _served_with(host, timeouts))
        document = _load(rds_text) if rds_text.strip() else None
        (resource,) = document["resources"]
        hosts = resource.get("virtual_hosts") or []
        routes = dict(_metadata_route(host) for host in hosts if _served_with(host, timeouts))
        return str(document["version_info"]), routes
    except (yaml.YAMLError, KeyError, TypeError, IndexError, ValueError) as exc:
        raise ValueError(f"not an rds file written by this adapter: {exc!r}") from exc


def read_clusters(cds_text: str) -> tuple[str, list[ClusterText]]:
    """Pure: the version and the clusters (name, text, digest) of a cds.yaml written by `assemble`.
    ValueError else. Blocking for a large file: call it through asyncio.to_thread."""
    try:
        head = _CDS_HEAD.match(cds_text)
        if head is not None:
            version = json.loads(cds_text[: cds_text.index(',"resources"')] + "}")["version_info"]
            clusters = []
            for resource, begin, end in _elements(cds_text, head.end()):
                text = cds_text[begin:end]
                clusters.append((str(resource["name"]), text, _digest(text)))
            return str(version), clusters
        document = _load(cds_text)
        clusters = []
        for resource in document["resources"]:
            text = _dumps(resource)
            clusters.append((str(resource["name"]), text, _digest(text)))
        return str(document["version_info"]), clusters
    except (yaml.YAMLError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a cds file written by this adapter: {exc!r}") from exc
