"""Pure: the two Envoy bootstraps (YAML) the sidecar hands out: `bootstrap` for file mode (Envoy
watches DIR/cds.yaml and DIR/rds.yaml, optionally reporting its load to the sidecar) and
`xds_bootstrap` for xDS mode (delta ADS from the sidecar, one scope per host, a stats matcher).

Owns no state and does no I/O. Imports the standard library, yaml, adapters.envoy.names and file
mode's file names and `ip_literal` (adapters.envoy.render); nothing imports it but the CLI, the
demo, tests and benchmarks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from adapters.envoy.render import CDS_FILE, RDS_FILE, ip_literal
from adapters.envoy.names import STAT_PREFIX

__all__ = ["ClientTls", "bootstrap", "not_prefixed", "xds_bootstrap"]

_HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_ROUTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"


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
    lrs: tuple[str, int] | None = None,
    tls: ClientTls | None = None,
) -> str:
    """Pure: an Envoy bootstrap (YAML) serving route configuration `route_config` from
    `envoy_dir/rds.yaml` and the clusters from `envoy_dir/cds.yaml` on one HTTP listener. With
    `lrs` (host, port), Envoy reports its requests per cluster to the sidecar's Load Reporting
    Service there (`run --envoy-lrs-listen`), which is how the sidecar checks the split it serves;
    with `tls`, over mutual TLS (`run --envoy-xds-tls-*`)."""
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
            "listeners": [_listener(listen_host, listen_port, hcm)]
        },
    }
    if lrs is not None:
        config["static_resources"]["clusters"] = [_grpc_cluster(_LRS_CLUSTER, *lrs, tls)]
        config["cluster_manager"] = _load_stats_config(_LRS_CLUSTER)
    return _with_admin(config, admin_host, admin_port)


_XDS_CLUSTER = "ome-xds"
# File mode's static cluster for the sidecar's Load Reporting Service.
_LRS_CLUSTER = "ome-lrs"
_HTTP_OPTIONS_TYPE = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def not_prefixed(*prefixes: str) -> str:
    """An RE2 pattern (RE2 has no lookahead) for whole names that start with none of `prefixes`:
    Envoy's safe_regex must match the whole stat name, hence the trailing `.*`."""
    trie: dict[str, Any] = {}
    for prefix in prefixes:
        node = trie
        for char in prefix[:-1]:
            node = node.setdefault(char, {})
        node[prefix[-1]] = None  # a prefix ends here: no name going this way is kept

    def alternatives(node: dict[str, Any]) -> str:
        others = "[^" + "".join(re.escape(char) for char in sorted(node)) + "]"
        deeper = [re.escape(char) + alternatives(rest) for char, rest in sorted(node.items()) if rest is not None]
        return "(?:" + "|".join([others, "$", *deeper]) + ")"  # `$`: a name shorter than the prefix

    return f"^{alternatives(trie)}.*$"


def _xds_stats_matcher(backend_stats: bool) -> dict[str, Any]:
    """Which stats Envoy keeps in xDS mode. Every stat a cluster makes is checked against the
    matcher as it is made: a prefix ending at a dot is checked on Envoy's tokens, anything else on
    the name as a string. With no cluster stats and no route configuration stats, all by token
    prefix, 40,000 clusters load in 2.5 s less (4.8-6.2 s instead of 7.7-9.1 s, with their scopes
    and routes, benchmarks/xds_scale.py) than when each map backend keeps its upstream_* stats.
    Either way every other stat (server, listener, HTTP, control plane, CDS) is kept; by default
    the xDS cluster's own go too (control_plane.connected_state says whether Envoy is connected)."""
    per_map_rds = f"http.{STAT_PREFIX}.rds."  # with scoped routes, every route configuration is a map's
    if not backend_stats:
        return {"exclusion_list": {"patterns": [{"prefix": "cluster."}, {"prefix": per_map_rds}]}}
    return {
        "inclusion_list": {
            "patterns": [
                {"safe_regex": {"regex": not_prefixed("cluster.ome|", per_map_rds)}},
                {"safe_regex": {"regex": r"^cluster\.ome\|.*\.upstream_[a-z0-9_]+$"}},
            ]
        }
    }


def _ads() -> dict[str, Any]:
    # How long Envoy's start waits for each subscription's first answer before it serves without:
    # CDS, then the scoped routes, one after the other, so an Envoy whose sidecar is not up serves
    # 404 for every host after twice this (Envoy's default, 15 s each, made it 30 s; 5 s made it 10).
    # A sidecar that is up answers in milliseconds, and what comes later applies as any update
    # (the pod is not ready before the sidecar has confirmed Envoy's first ACK either way). Not 0:
    # to Envoy that means wait forever.
    return {"ads": {}, "resource_api_version": "V3", "initial_fetch_timeout": "2s"}


def _listener(host: str, port: int, hcm: dict[str, Any]) -> dict[str, Any]:
    """The one HTTP listener both bootstraps serve the published hosts on."""
    return {
        "name": "ome-global",
        "address": _socket(host, port),
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}],
    }


_TLS_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"


@dataclass(frozen=True)
class ClientTls:
    """Envoy's side of the xDS (and LRS) server's mutual TLS: its client certificate and key, the
    CA that signed the server's certificate, and the name that certificate must carry."""

    cert: Path
    key: Path
    ca: Path
    server_name: str


def _transport_socket(tls: ClientTls) -> dict[str, Any]:
    """Envoy's TLS to the publisher: it presents its client certificate, trusts only `tls.ca`, and
    requires the server certificate to name `tls.server_name` in its subject alternative names (a
    DNS name, sent as SNI too; an IP address as an IP SAN, as SNI carries no addresses). Files are
    read when Envoy starts: a rotated client certificate takes a restart of Envoy."""
    address = ip_literal(tls.server_name)
    san = {"san_type": "IP_ADDRESS", "matcher": {"exact": address}} if address else {"san_type": "DNS", "matcher": {"exact": tls.server_name}}
    context: dict[str, Any] = {
        "@type": _TLS_TYPE,
        "common_tls_context": {
            "tls_params": {"tls_minimum_protocol_version": "TLSv1_2", "tls_maximum_protocol_version": "TLSv1_3"},
            "alpn_protocols": ["h2"],
            "tls_certificates": [
                {"certificate_chain": {"filename": str(Path(tls.cert).absolute())}, "private_key": {"filename": str(Path(tls.key).absolute())}}
            ],
            "validation_context": {
                "trusted_ca": {"filename": str(Path(tls.ca).absolute())},
                "match_typed_subject_alt_names": [san],
            },
        },
    }
    if address is None:
        context["sni"] = tls.server_name
    return {"name": "envoy.transport_sockets.tls", "typed_config": context}


def _grpc_cluster(name: str, host: str, port: int, tls: ClientTls | None = None) -> dict[str, Any]:
    """A static HTTP/2 cluster for one of the sidecar's gRPC servers (xDS, or file mode's LRS),
    over mutual TLS with `tls`."""
    address = ip_literal(host)
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC" if address else "STRICT_DNS",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _HTTP_OPTIONS_TYPE,
                "explicit_http_config": {"http2_protocol_options": {"connection_keepalive": {"interval": "15s", "timeout": "5s"}}},
            }
        },
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _socket(address or host, port)}}]}],
        },
    }
    if tls is not None:
        cluster["transport_socket"] = _transport_socket(tls)
    return cluster


def _load_stats_config(cluster: str) -> dict[str, Any]:
    """cluster_manager: Envoy reports its requests per cluster to `cluster` (Load Reporting Service)."""
    return {
        "load_stats_config": {
            "api_type": "GRPC",
            "transport_api_version": "V3",
            "grpc_services": [{"envoy_grpc": {"cluster_name": cluster}}],
        }
    }


def _with_admin(config: dict[str, Any], admin_host: str | None, admin_port: int | None) -> str:
    if admin_host is not None and admin_port is not None:
        config["admin"] = {"address": _socket(admin_host, admin_port)}
    return yaml.safe_dump(config, sort_keys=False)


def xds_bootstrap(
    *,
    xds_host: str,
    xds_port: int,
    listen_host: str,
    listen_port: int,
    admin_host: str | None = None,
    admin_port: int | None = None,
    backend_stats: bool = False,
    load_stats: bool = True,
    tls: ClientTls | None = None,
) -> str:
    """Pure: an Envoy bootstrap (YAML) taking clusters, scopes and routes from the sidecar's delta
    ADS server at xds_host:xds_port, serving them on one HTTP listener; each host is one scope.
    `backend_stats` keeps each map backend's upstream_* stats, at a cost (see _xds_stats_matcher).
    `load_stats` has Envoy report its requests per cluster to the same server (Load Reporting
    Service), which is how the sidecar checks the split it serves. With `tls`, both over mutual
    TLS (the publisher's `run --envoy-xds-tls-*`)."""
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
    config: dict[str, Any] = {
        "node": {"id": "ome-gateway-envoy", "cluster": "ome-gateway"},
        "deferred_stat_options": {"enable_deferred_creation_stats": True},
        "stats_config": {"stats_matcher": _xds_stats_matcher(backend_stats)},
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
                            # The sidecar is local: at most 0.5 s apart, an Envoy started first
                            # connects within half a second of the sidecar listening (2 s made a
                            # first publish of 1,000 maps take 5.4 s instead of 1.8 s).
                            "retry_policy": {"retry_back_off": {"base_interval": "0.1s", "max_interval": "0.5s"}},
                            "max_receive_message_length": 64 * 1024 * 1024,
                        }
                    }
                ],
            },
            "cds_config": _ads(),
        },
        "static_resources": {
            "clusters": [_grpc_cluster(_XDS_CLUSTER, xds_host, xds_port, tls)],
            "listeners": [_listener(listen_host, listen_port, hcm)],
        },
    }
    # A worker builds its copy of a cluster when it first routes to it, not when the cluster comes:
    # at 10,000 map clusters 28 MB less (benchmarks/README.md, "Issue 29: a lighter Envoy").
    config["cluster_manager"] = {"enable_deferred_cluster_creation": True}
    if load_stats:
        config["cluster_manager"] |= _load_stats_config(_XDS_CLUSTER)
    return _with_admin(config, admin_host, admin_port)
