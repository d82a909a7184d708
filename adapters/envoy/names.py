"""Pure: the names the sidecar gives its Envoy clusters, shared by file mode, the xDS resources and
the load reports that name them back, and the prefix of its HTTP stats (the bootstraps set it, the
admin client reads stats under it). File mode has a cluster per map backend (`cluster_name`); xDS
mode one per map (`map_cluster_name`), each backend in it a locality named after the backend."""

from __future__ import annotations

from publisher.core.values import MapKey

__all__ = ["STAT_PREFIX", "cluster_name", "map_cluster_name", "parse_cluster_name", "parse_map_cluster_name"]

# The HTTP connection manager's stat_prefix in both bootstraps: Envoy's RDS stats are http.ome.rds.*.
STAT_PREFIX = "ome"


def cluster_name(key: MapKey, cluster: str) -> str:
    """The Envoy cluster for one map entry: stable, and unique because `|` is in no DNS name."""
    return f"ome|{key.namespace}|{key.name}|{cluster}"


def parse_cluster_name(name: str) -> tuple[MapKey, str] | None:
    """The map and backend cluster a `cluster_name` names; None for any other cluster."""
    parts = name.split("|")
    if len(parts) != 4 or parts[0] != "ome":
        return None
    return MapKey(parts[1], parts[2]), parts[3]


def map_cluster_name(key: MapKey) -> str:
    """xDS mode's one Envoy cluster for a whole map (also its scope's and route configuration's name)."""
    return f"ome|{key.namespace}|{key.name}"


def parse_map_cluster_name(name: str) -> MapKey | None:
    """The map a `map_cluster_name` names; None for any other cluster."""
    parts = name.split("|")
    if len(parts) != 3 or parts[0] != "ome":
        return None
    return MapKey(parts[1], parts[2])
