"""Pure: the HTTPRoute transport's ownership bookkeeping. What it knows of one map's objects on
the gateway's cluster and how it judges them against what the renderer would write (MapObjects),
and of all of them (OwnedObjects): which routes and Services are ours, which names are claimed,
what a write must apply, move or delete."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from adapters.httproute.options import HttpRouteOptions
from adapters.httproute.render import (
    CLUSTER_ANNOTATION,
    UNKNOWN_ROUTE,
    BackendRef,
    ObjectGroup,
    contains_fields,
    is_ours,
    map_of,
    parse_route,
    render_service,
    route_verdict,
)
from publisher.core.values import Held, MapKey, Reason, Route

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


def claim_problem(route: Mapping[str, Any], key: MapKey, options: HttpRouteOptions) -> str | None:
    """Why `key` may not take `route`, which holds the name its route would have: None when the
    route is ours for this map already (written since we last read)."""
    where = f"route {'/'.join(object_name(route))}"
    if not is_ours(route, options.region):
        return f"{where} exists without this publisher's labels; it is left untouched"
    if (owner := map_of(route, options.region)) != key:
        return f"{where} already publishes {owner or 'an unreadable map'}"
    return None


class OwnedObjects:
    """Pure: which objects on the gateway's cluster are ours, by map, as last read or written, and
    what a write has to do with them. The transport does the I/O and tells this value what it did.

    A route name is owned by one map at a time: by the map whose route of ours holds it, or by the
    map whose write is claiming it (until the cluster shows it is taken)."""

    def __init__(self, options: HttpRouteOptions) -> None:
        self._options = options
        self._maps: dict[MapKey, MapObjects] = {}
        self._owners: dict[ObjectName, MapKey] = {}  # our routes (and names being claimed) -> their map
        self._orphans: set[MapKey] = set()  # maps with Services of ours but no route, as last read

    # --- learning what the cluster holds (read) ------------------------------------------------------

    def add_route(self, route: Mapping[str, Any]) -> MapKey | None:
        """Take in one listed route of ours, keeping only what a later write needs; its map, or
        None when the route names no map we can read (it is then left alone)."""
        key = map_of(route, self._options.region)
        if key is None:
            return None
        try:
            group, exact = parse_route(route, self._options)
        except (KeyError, ValueError, TypeError):
            group, exact = None, False
        refused = isinstance(route_verdict(route, self._options), Held)
        name = object_name(route)
        self._maps[key], self._owners[name] = MapObjects(name, group, exact, refused), key
        return key

    def add_service(self, service: Mapping[str, Any]) -> MapKey | None:
        """Take in one listed Service of ours (after every route): its map, or None as add_route."""
        key = map_of(service, self._options.region)
        if key is None:
            return None
        state = self._maps.setdefault(key, MapObjects())
        state.services[object_name(service)] = service_spec(service, state.group, self._options)
        return key

    def served(self) -> Iterator[tuple[MapKey, Route]]:
        """Once everything is added: what each map with a route of ours serves (UNKNOWN_ROUTE when
        its objects are not as we render them), one map at a time; maps with Services but no route
        become orphans."""
        self._orphans = {key for key, state in self._maps.items() if state.route is None}
        for key, state in self._maps.items():
            if state.route is not None:
                yield key, state.group.served if state.group is not None and serves(state) else UNKNOWN_ROUTE

    # --- planning a write --------------------------------------------------------------------------

    def withdrawals(self, parts: Mapping[MapKey, object], changes: Mapping[MapKey, object | None]) -> list[MapKey]:
        """The maps to withdraw, in order: those `changes` removes, and orphans no map keeps."""
        orphans = [k for k in self._orphans if k not in parts and k not in changes]
        return sorted([k for k, group in changes.items() if group is None] + orphans)

    def orphans_collected(self) -> None:
        self._orphans.clear()

    def claim(self, publish: Mapping[MapKey, ObjectGroup]) -> tuple[dict[MapKey, Held], list[MapKey]]:
        """Claims each map's route name: refusals of names another map of ours holds (the first key
        in order keeps a name two maps ask for at once), and the maps whose name we hold no route
        of ours under, which the cluster must be asked about (see settle_claim)."""
        rejected: dict[MapKey, Held] = {}
        lookup: list[MapKey] = []
        for key, group in publish.items():
            name = (group.namespace, group.route)
            owner = self._owners.get(name)
            if owner is None:
                self._owners[name] = key
                lookup.append(key)
            elif owner != key:
                rejected[key] = Held(Reason.CLAIM_REJECTED, f"route {name[0]}/{name[1]} already publishes {owner}")
        return rejected, lookup

    def settle_claim(self, group: ObjectGroup, route: Mapping[str, Any] | None) -> Held | None:
        """The claim of `group`'s map on its route name, given the route the cluster holds under it
        (None: none): a refusal, which gives the name up, or None when the map may write it."""
        if route is None or (problem := claim_problem(route, group.key, self._options)) is None:
            return None
        del self._owners[(group.namespace, group.route)]
        return Held(Reason.CLAIM_REJECTED, problem)

    def stale_services(self, group: ObjectGroup) -> list[tuple[ObjectName, BackendRef]]:
        """The Services of `group` the cluster does not hold as we render them."""
        services = self._maps.setdefault(group.key, MapObjects()).services
        return [
            ((group.namespace, ref.service), ref)
            for ref in group.refs
            if services.get((group.namespace, ref.service)) != (ref.cluster, ref.external_name)
        ]

    def route_stale(self, group: ObjectGroup) -> bool:
        """Whether `group`'s route must be applied: ours is elsewhere, not as rendered, or another."""
        state = self._maps.setdefault(group.key, MapObjects())
        return state.route != (group.namespace, group.route) or not state.exact or state.group != group

    def route_moved(self, group: ObjectGroup) -> ObjectName | None:
        """A route of ours for `group`'s map under another name (other options since we last ran),
        to delete once `group`'s route is written."""
        route = self._maps.setdefault(group.key, MapObjects()).route
        return route if route not in (None, (group.namespace, group.route)) else None

    def refused(self, key: MapKey) -> bool:
        """Whether the gateway's last verdict on the map's route was a refusal."""
        state = self._maps.get(key)
        return state is not None and state.refused

    def unused_services(self, group: ObjectGroup) -> list[ObjectName]:
        """Services of ours for `group`'s map that its route no longer points at."""
        wanted = {(group.namespace, ref.service) for ref in group.refs}
        return [name for name in self._maps.setdefault(group.key, MapObjects()).services if name not in wanted]

    def withdrawal(self, key: MapKey) -> tuple[ObjectName | None, ObjectGroup | None, list[ObjectName]] | None:
        """What withdrawing a map takes: its route, the group to write with every weight at 0 first
        (None when it already is, or is unknown), and its Services. None when nothing is ours."""
        state = self._maps.get(key)
        if state is None:
            return None
        zeroed = state.group.zeroed() if state.route is not None and state.group is not None and not state.group.all_zero else None
        return state.route, zeroed, list(state.services)

    # --- what the transport did ----------------------------------------------------------------------

    def service_written(self, key: MapKey, name: ObjectName, ref: BackendRef) -> None:
        self._maps.setdefault(key, MapObjects()).services[name] = (ref.cluster, ref.external_name)

    def service_deleted(self, key: MapKey, name: ObjectName) -> None:
        del self._maps[key].services[name]

    def route_written(self, group: ObjectGroup) -> None:
        """`group`'s route is applied, and the route it moved from (route_moved) deleted."""
        state = self._maps.setdefault(group.key, MapObjects())
        if state.route is not None:
            self._owners.pop(state.route, None)
        state.route, state.group, state.exact = (group.namespace, group.route), group, True
        self._owners[state.route] = group.key

    def route_zeroed(self, key: MapKey) -> None:
        state = self._maps[key]
        state.group = state.group.zeroed() if state.group is not None else None

    def route_deleted(self, key: MapKey) -> None:
        state = self._maps[key]
        if state.route is not None:
            self._owners.pop(state.route, None)
        state.route = state.group = None

    def judged(self, key: MapKey, verdict: Held | bool | None) -> None:
        """The gateway's verdict on the route just written for `key`."""
        self._maps[key].refused = isinstance(verdict, Held)

    def forget(self, key: MapKey) -> None:
        """The map is withdrawn: nothing of ours is left for it."""
        del self._maps[key]
