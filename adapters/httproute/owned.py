"""Pure: what the transport knows of one map's objects on the gateway's cluster, and how it
judges them against what the renderer would write."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from adapters.httproute.options import HttpRouteOptions
from adapters.httproute.render import CLUSTER_ANNOTATION, ObjectGroup, contains_fields, render_service, route_verdict
from publisher.model import Held, MapKey

ObjectName = tuple[str, str]  # (namespace, name)
ServiceSpec = tuple[str, str]  # (cluster, externalName): all a Service of ours varies in


@dataclass(slots=True)
class MapObjects:
    """What the cluster holds for one map, as far as we know. Our options are fixed for the
    transport's life, so a group names a route's whole body and a ServiceSpec a Service's."""

    route: ObjectName | None = None  # our route for this map, None when there is none
    group: ObjectGroup | None = None  # what the route holds; None when it is unreadable
    exact: bool = False  # whether the route is exactly as `group` renders
    refused: bool = False  # whether the gateway's last verdict on the route was a refusal
    services: dict[ObjectName, ServiceSpec | None] = field(default_factory=dict)  # None: differs


def object_name(obj: Mapping[str, Any]) -> ObjectName:
    return (obj["metadata"]["namespace"], obj["metadata"]["name"])


def take_verdict(
    verdicts: dict[MapKey, Held | bool | None], waiting: dict[ObjectName, MapKey], route: Mapping[str, Any], options: HttpRouteOptions
) -> None:
    """Record the verdict `route` carries, when it is one of those `waiting` and carries one."""
    key = waiting.get(object_name(route))
    if key is not None and (verdict := route_verdict(route, options)) is not None:
        verdicts[key] = verdict
        del waiting[object_name(route)]


def service_spec(service: Mapping[str, Any], group: ObjectGroup | None, options: HttpRouteOptions) -> ServiceSpec | None:
    """The ServiceSpec a Service of ours holds, when it is exactly as we render it for `group`."""
    if group is None:
        return None
    metadata = service.get("metadata") or {}
    cluster = (metadata.get("annotations") or {}).get(CLUSTER_ANNOTATION)
    ref = next((r for r in group.refs if r.cluster == cluster and r.service == metadata.get("name")), None)
    if ref is None or metadata.get("namespace") != group.namespace:
        return None
    return (ref.cluster, ref.external_name) if contains_fields(service, render_service(group, ref, options)) else None


def serves(state: MapObjects) -> bool:
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
