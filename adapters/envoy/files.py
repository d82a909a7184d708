"""The Envoy adapter in file mode: a pure renderer, and a transport that owns two watched files.

The renderer turns one map's Route into its clusters and virtual host (`weighted_clusters` on `/`;
no generation: a generation-only change renders the same part). The transport owns `DIR/cds.yaml`
and `DIR/rds.yaml`, xDS DiscoveryResponses in JSON (valid YAML) whose `version_info` digests the
content, joins the parts into them and replaces them by rename; with `--envoy-admin` each write is
confirmed from Envoy's version readouts (the rejection counters only when a version is late), and
a rejected one restores the last confirmed files; with `--envoy-lrs-listen` it also serves Envoy's
load reports for the served-split check (adapters.envoy.lrs). Read-back parses off the event loop.
Hostname ownership and isolating a rejected map are the engine's. `build` (adapters.envoy) picks
this mode or the xDS server (adapters.envoy.xds) from `envoy_xds_listen`. It decides nothing about
maps and imports no metrics.

Imports adapters.base, adapters.route_json, adapters.timeouts, publisher.model and, in this
package, names, options and admin (the admin API client; adapters.envoy.lrs only when asked for).
The bootstraps (adapters.envoy.bootstrap) and a real Envoy (adapters.envoy.process) are elsewhere.
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
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import yaml

from adapters.base import (
    Rejected,
    TransportDefaults,
    Unavailable,
    WriteResult,
    duplicate_hostname,
    envoy_weight_sum_problem,
    in_words,
    publication_problem,
    write_atomic,
)
from adapters.envoy.admin import EnvoyAdmin, PerSubscription
from adapters.envoy.names import cluster_name
from adapters.envoy.options import EnvoyOptions
from adapters.route_json import from_json as route_from_json
from adapters.route_json import to_json as route_json
from adapters.timeouts import DEFAULT_ROUTE_IDLE_TIMEOUT, DEFAULT_ROUTE_TIMEOUT, envoy_duration
from publisher.model import MapKey, Publication, Route, parse_endpoint

if TYPE_CHECKING:
    from adapters.envoy.lrs import LoadReportServer


# The name it had before the move into adapters/envoy/: log filters keep working.
log = logging.getLogger("adapters.envoy")

__all__ = [
    "CDS_FILE",
    "RDS_FILE",
    "EnvoyFileTransport",
    "EnvoyIO",
    "EnvoyOptions",
    "EnvoyPart",
    "EnvoyRenderer",
    "Rendered",
    "assemble",
    "build_files",
    "cluster_name",
    "ip_literal",
    "read_clusters",
    "read_routes",
    "render",
    "route_timeouts",
]

CDS_FILE = "cds.yaml"
RDS_FILE = "rds.yaml"
METADATA_KEY = "ome-gateway-publisher"
_CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
_ROUTE_TYPE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
_TLS_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"

_DEFAULT_CA: Path = EnvoyOptions.model_fields["envoy_ca_file"].default


# --- Pure: validation, rendering, read-back ----------------------------------------------------------


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


_Cluster = tuple[str, str, bytes]  # (name, JSON text, digest)


@dataclass(frozen=True, slots=True)
class EnvoyPart:
    """One map's share of both files, rendered once: JSON text (which is YAML, and which json.loads
    reads back far faster than a YAML parser). Equal parts are served the same."""

    hostname: str
    virtual_host: str
    virtual_host_digest: bytes = field(compare=False)
    clusters: tuple[_Cluster, ...]  # in backend order


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


def _cds_text(clusters: list[_Cluster]) -> tuple[str, str]:
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
    clusters: list[_Cluster] = field(repr=False)


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
    cds_version, cds = _cds_text(clusters)
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


def read_clusters(cds_text: str) -> tuple[str, list[_Cluster]]:
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


# --- I/O: the directory Envoy watches, and its admin API ----------------------------------------------


class EnvoyIO:
    """Files in the watched directory and reads from the admin API (adapters.envoy.admin); unit
    tests replace it."""

    def __init__(self, directory: Path, admin_url: str | None, route_config: str) -> None:
        self._directory = directory
        self._admin = EnvoyAdmin(admin_url, route_config) if admin_url else None

    @property
    def confirms(self) -> bool:
        return self._admin is not None

    async def read(self, filename: str) -> str | None:
        try:
            return await asyncio.to_thread((self._directory / filename).read_text)
        except FileNotFoundError:
            return None

    async def write(self, filename: str, text: str) -> None:
        await asyncio.to_thread(write_atomic, self._directory / filename, text.encode())

    @property
    def admin(self) -> EnvoyAdmin:
        assert self._admin is not None, "no --envoy-admin: nothing to ask"
        return self._admin

    async def versions(self, timeout: float = 5.0) -> PerSubscription:
        return await self.admin.versions(timeout)

    async def rejections(self, timeout: float = 5.0) -> PerSubscription:
        return await self.admin.rejections(timeout)

    async def warming_clusters(self, timeout: float = 5.0) -> int:
        return await self.admin.warming_clusters(timeout)

    async def served_rds(self) -> str:
        return await self.admin.served_rds()

    async def aclose(self) -> None:
        if self._admin is not None:
            await self._admin.aclose()


@contextlib.asynccontextmanager
async def _translated(what: str) -> AsyncIterator[None]:
    """The one place I/O errors of this gateway become AdapterErrors."""
    try:
        yield
    except (OSError, aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError) as exc:
        raise Unavailable(f"envoy: {what}: {in_words(exc)}") from exc


class _EnvoyRejected(Exception):
    def __init__(self, what: str, version: str) -> None:
        super().__init__(f"envoy rejected {what} version {version} ({what}.update_rejected rose); Envoy's log has its reason")


# --- The transport ------------------------------------------------------------------------------------


class EnvoyFileTransport(TransportDefaults):
    """The `Transport` of file mode: see the module docstring. The engine drives it, one call at a time."""

    # Each write is a file Envoy reloads (WriteResult.reloads), counted in reloads_total.
    reloads_gateway = True

    # How long Envoy gets to take one file beyond the work it carries: a rename of a small change
    # reloads within milliseconds; past the deadline the write is reported Unavailable and retried.
    confirm_timeout = 10.0
    # Envoy 1.40 spends 0.6-1.2 ms of its main thread per cluster it adds on a 2-core machine (40,000
    # in 25-46 s) and blocks its admin API meanwhile; three times that, per cluster added or removed,
    # lets a first publish of 10,000 maps finish instead of timing out and starting over.
    seconds_per_cluster = 0.003
    # Envoy re-reads the whole rds file on each change; a generous allowance per virtual host in it.
    seconds_per_virtual_host = 0.001
    # A rejected update never shows its version. Once a version is this late, and again each time
    # the wait doubles, one costly counter read tells a rejection from a slow reload.
    rejection_check_after = 0.25

    def __init__(self, options: EnvoyOptions, *, io: EnvoyIO | None = None, load_reports: LoadReportServer | None = None) -> None:
        assert options.envoy_dir is not None, "the file transport needs envoy_dir"
        self._options = options
        self._io = io or EnvoyIO(options.envoy_dir, options.envoy_admin, options.envoy_route_config)
        # File mode's Load Reporting Service (adapters.envoy.lrs.LoadReportServer), when configured:
        # only then is there a request_counter, and the served-split check counts.
        self._load_reports = load_reports
        if load_reports is not None:
            self.request_counter = load_reports.request_counter
        # The files' versions as Envoy holds them ("" when unknown: the next write rewrites that file).
        self._rds_version = ""
        self._cds_version = ""
        # The clusters Envoy holds (old ones leave only after the routes naming them), and the two
        # files Envoy last confirmed: what a rejected write restores. None: unknown.
        self._held_clusters: list[_Cluster] = []
        self._confirmed: tuple[str, str] | None = None
        # Envoy's update_rejected counters as last read (None: not yet): a rise means a rejection.
        self._rejections: PerSubscription | None = None

    async def read(self) -> dict[MapKey, Route]:
        """What Envoy serves: the files when Envoy holds their versions (or is not up yet, and will
        load them), else Envoy's own route configuration. Parsed off the event loop."""
        async with _translated("reading back"):
            rds = await self._io.read(RDS_FILE)
            cds = await self._io.read(CDS_FILE)
            served = await self._served_versions()
            holds_nothing = served is None or (served.rds, served.cds) == ("", "")
            if (rds is None or cds is None) and (self._confirmed is not None or holds_nothing):
                # A missing file: the last confirmed ones go back; with none known and nothing of
                # ours in Envoy, empty ones (it cannot start without both). Else Envoy keeps what it has.
                if self._confirmed is not None:
                    cds, rds = self._confirmed
                else:
                    empty = assemble({}, route_config=self._options.envoy_route_config)
                    cds, rds = empty.cds, empty.rds
                await self._io.write(CDS_FILE, cds)
                await self._io.write(RDS_FILE, rds)
            in_rds = await asyncio.to_thread(self._read_routes, rds) if rds is not None else None
            in_cds = await asyncio.to_thread(read_clusters, cds) if cds is not None else None
            if in_rds and in_cds and (served is None or (served.rds, served.cds) == (in_rds[0], in_cds[0])):
                assert rds is not None and cds is not None
                self._rds_version, self._cds_version = in_rds[0], in_cds[0]
                self._held_clusters, self._confirmed = in_cds[1], (cds, rds)
                routes = in_rds[1]
            else:
                assert served is not None  # without an Envoy answering, both files exist by now
                log.warning(
                    "envoy serves other versions than its files",
                    extra={"served_rds": served.rds, "served_cds": served.cds,
                           "file_rds": in_rds and in_rds[0], "file_cds": in_cds and in_cds[0]},
                )  # fmt: skip
                # What Envoy serves is known only from its own dump: the first write rewrites both
                # files, and a rejection then has nothing confirmed to restore.
                self._rds_version = self._cds_version = ""
                self._held_clusters = in_cds[1] if in_cds and in_cds[0] == served.cds else []
                self._confirmed = None
                if in_rds and in_rds[0] == served.rds:
                    routes = in_rds[1]
                else:
                    _, routes = await asyncio.to_thread(self._read_routes, await self._io.served_rds())
        log.info("envoy state read back", extra={"maps": len(routes), "rds_version": self._rds_version})
        return routes

    def _read_routes(self, rds_text: str) -> tuple[str, dict[MapKey, Route]]:
        """read_routes, with the timeouts this sidecar renders: after they change, every map is
        written again, not only the next one that changes."""
        timeouts = route_timeouts(self._options.route_timeout, self._options.route_idle_timeout)
        return read_routes(rds_text, timeouts=timeouts)

    async def _served_versions(self) -> PerSubscription | None:
        """The versions Envoy holds, or None when there is no admin API or Envoy is not up yet."""
        if not self._io.confirms:
            return None
        try:
            return await self._io.versions()
        except (OSError, aiohttp.ClientError, asyncio.TimeoutError):
            return None  # Envoy not up yet: it will load the files.

    async def write(self, parts: Mapping[MapKey, EnvoyPart], changes: Mapping[MapKey, EnvoyPart | None]) -> WriteResult:
        """Make Envoy serve `parts`: new clusters first, then the routes, then old clusters leave.
        Rejected: Envoy refused, and the last confirmed files are back. Unavailable: not confirmed."""
        route_config = self._options.envoy_route_config
        try:
            files = await asyncio.to_thread(assemble, parts, route_config=route_config)
        except ValueError as exc:
            raise Rejected(f"envoy: {exc}") from exc
        if (files.rds_version, files.cds_version) == (self._rds_version, self._cds_version):
            return WriteResult()
        writes = 0
        try:
            async with _translated("writing"):
                if files.cds_version != self._cds_version:
                    names = {name for name, _, _ in files.clusters}
                    leftovers = [c for c in self._held_clusters if c[0] not in names]
                    held_names = {name for name, _, _ in self._held_clusters}
                    added = [text for name, text, _ in files.clusters if name not in held_names]
                    first_version, first_text = (
                        _cds_text(files.clusters + leftovers) if files.rds_version != self._rds_version and leftovers
                        else (files.cds_version, files.cds)
                    )  # fmt: skip
                    writes += 1
                    await self._write(
                        CDS_FILE, first_text, first_version, "cds",
                        allowance=self.seconds_per_cluster * len(added),
                        # Only a cluster that resolves a name warms for long; an IP one is active at once.
                        warming=any('"type":"LOGICAL_DNS"' in text for text in added),
                    )  # fmt: skip
                    self._cds_version = first_version
                    self._held_clusters = files.clusters + (leftovers if first_version != files.cds_version else [])
                if files.rds_version != self._rds_version:
                    writes += 1
                    await self._write(
                        RDS_FILE, files.rds, files.rds_version, "rds", allowance=self.seconds_per_virtual_host * len(parts)
                    )
                    self._rds_version = files.rds_version
                if files.cds_version != self._cds_version:
                    writes += 1
                    leftover_count = len(self._held_clusters) - len(files.clusters)
                    await self._write(
                        CDS_FILE, files.cds, files.cds_version, "cds", allowance=self.seconds_per_cluster * leftover_count
                    )
                    self._cds_version = files.cds_version
                    self._held_clusters = files.clusters
        except _EnvoyRejected as exc:
            log.warning("envoy rejected an update", extra={"maps": len(changes), "error": str(exc)})
            await self._restore()
            raise Rejected(str(exc)) from exc
        self._confirmed = (files.cds, files.rds)
        log.debug("envoy updated", extra={"rds_version": files.rds_version, "cds_version": files.cds_version, "writes": writes})
        return WriteResult(reloads=writes)

    async def _write(
        self, filename: str, text: str, version: str, what: str, *, allowance: float = 0.0, warming: bool = False
    ) -> None:
        """Write one file; with an admin URL, wait until Envoy took exactly this version."""
        if self._io.confirms and self._rejections is None:
            self._rejections = await self._read_rejections()
        await self._io.write(filename, text)
        if self._io.confirms:
            await self._confirm(what, version, self.confirm_timeout + allowance, warming=warming)

    async def _confirm(self, what: str, version: str, timeout: float, *, warming: bool) -> None:
        """Poll the cheap version readouts until `version` shows; read the costly rejection counters
        only while it is late. Raises _EnvoyRejected, or TimeoutError past `timeout`."""
        start = time.monotonic()
        deadline = start + timeout
        check_at = start + self.rejection_check_after
        delay = 0.001
        while (await self._io.versions(max(deadline - time.monotonic(), 1.0))).of(what) != version:
            now = time.monotonic()
            if now >= check_at or now >= deadline:
                await self._check_rejected(what, version, max(deadline - now, 1.0))
                if now >= deadline:
                    raise asyncio.TimeoutError(f"{what} version {version} not confirmed in {timeout:.1f}s")
                check_at = now + (now - start)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
        while warming and await self._io.warming_clusters(max(deadline - time.monotonic(), 1.0)) > 0:
            if time.monotonic() > deadline:
                raise asyncio.TimeoutError(f"{what} version {version}: clusters still warming after {timeout:.1f}s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    async def _read_rejections(self) -> PerSubscription | None:
        try:
            return await self._io.rejections(self.confirm_timeout)
        except (OSError, aiohttp.ClientError, asyncio.TimeoutError):
            return None  # Envoy not up: the first late version reads them instead.

    async def _check_rejected(self, what: str, version: str, timeout: float) -> None:
        before, self._rejections = self._rejections, await self._io.rejections(timeout)
        if before is not None and self._rejections.of(what) > before.of(what):
            raise _EnvoyRejected(what, version)

    async def _restore(self) -> None:
        """Put the last confirmed files back and wait until Envoy holds them again. Unavailable
        when there are none, or Envoy does not take them back."""
        if self._confirmed is None:
            self._rds_version = self._cds_version = ""
            raise Unavailable("envoy rejected an update, and no confirmed files are known to restore")
        cds, rds = self._confirmed
        cds_version, clusters = await asyncio.to_thread(read_clusters, cds)
        rds_version, routes = await asyncio.to_thread(read_routes, rds)
        self._rds_version = self._cds_version = ""
        try:
            async with _translated("restoring"):
                await self._write(CDS_FILE, cds, cds_version, "cds", allowance=self.seconds_per_cluster * len(clusters))
                await self._write(RDS_FILE, rds, rds_version, "rds", allowance=self.seconds_per_virtual_host * len(routes))
        except _EnvoyRejected as exc:
            raise Unavailable(f"envoy: restoring the last confirmed files: {exc}") from exc
        self._rds_version, self._cds_version, self._held_clusters = rds_version, cds_version, clusters

    async def serve(self) -> None:
        """The Load Reporting Service's server until cancelled, when configured."""
        if self._load_reports is not None:
            await self._load_reports.serve()

    async def aclose(self) -> None:
        await self._io.aclose()


def build_files(options: EnvoyOptions) -> tuple[EnvoyRenderer, EnvoyFileTransport]:
    """File mode's renderer and transport for the engine."""
    renderer = EnvoyRenderer(
        rewrite_host=options.rewrite_host,
        ca_file=options.envoy_ca_file,
        timeout=options.route_timeout,
        idle_timeout=options.route_idle_timeout,
    )
    return renderer, EnvoyFileTransport(options, load_reports=_load_report_server(options))


def _load_report_server(options: EnvoyOptions) -> LoadReportServer | None:
    """File mode's LRS server on --envoy-lrs-listen, or None: not asked for, or no grpcio."""
    if options.envoy_lrs_listen is None:
        return None
    try:
        from adapters.envoy.lrs import LoadReportServer
    except ImportError as exc:
        log.warning("envoy file mode counts no requests: the load report server needs grpcio", extra={"error": str(exc)})
        return None
    return LoadReportServer(options.envoy_lrs_listen)
