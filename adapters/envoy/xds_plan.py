"""Pure: one Envoy's xDS session as data, and the plan that brings it to the target.

`EnvoyState` is what one Envoy told us and acknowledged: the resources it holds (name -> version,
from its ACKs and from the versions it lists when it reconnects), the types and route
configurations it subscribed, the first requests still owed an answer, the maps to look at
(`dirty`) and the parts it refused. `plan` is the next step toward the target for a set of maps,
recomputed from that state after every answer, in the order Envoy needs: clusters ACKed before
any route names them, scopes of withdrawn maps removed before new scopes take their host, route
configurations once Envoy subscribed them, clusters no route names any more last. A map the
engine neither wrote nor withdrew is never touched. No I/O, no asyncio, no logging: the stream
pump in adapters.envoy.xds sends what the plan says and feeds the answers back.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass, field

from envoy.service.discovery.v3 import discovery_pb2

from adapters.envoy.resources import CLUSTER_TYPE, ROUTE_TYPE, SCOPE_TYPE, MapResources, Resource, key_of, map_name, served_route
from publisher.core.values import MapKey, Route

__all__ = [
    "KIND",
    "AwaitRequest",
    "EnvoyState",
    "Item",
    "Send",
    "WriteAnswer",
    "add_votes",
    "fleet_message",
    "most_voted",
    "plan",
    "served_by_most",
    "served_versions",
    "words",
    "write_outcome",
]

KIND = {CLUSTER_TYPE: "cluster", SCOPE_TYPE: "scope", ROUTE_TYPE: "route"}
# How much of one Envoy's error_detail a refusal keeps (a batch's NACK lists every resource), and
# how many Envoys one map's message names: messages end up in a status condition.
WORDS_CHARS = 300
NAMED_ENVOYS = 3


def words(error: str) -> str:
    """Pure: an Envoy's error text, on one line and at most WORDS_CHARS long."""
    text = " ".join(error.split())
    return text if len(text) <= WORDS_CHARS else f"{text[:WORDS_CHARS - 1]}…"


def fleet_message(refusals: list[str], pending: list[str], took: int) -> str:
    """Pure: one map's message when not every Envoy took it: the refusals (each "envoy X refused
    the K: words"), the Envoys that had not answered for it when the write stopped waiting (they
    refuse other maps), and how many serve it. At most NAMED_ENVOYS Envoys are named."""
    named = (refusals + [f"envoy {name} has not acknowledged it (it refuses other maps)" for name in pending])
    parts = named[:NAMED_ENVOYS]
    if len(named) > NAMED_ENVOYS:
        parts.append(f"and {len(named) - NAMED_ENVOYS} more Envoys")
    if took:
        parts.append(f"held back on those; {took} other Envoy{'s' if took > 1 else ''} serve{'' if took > 1 else 's'} it")
    return "; ".join(parts)


@dataclass
class Item:
    """One map's share of one response (for `part` of the target, None when withdrawn):
    resources to add or update, names to remove."""

    key: MapKey
    part: MapResources | None
    resources: tuple[Resource, ...] = ()
    removed: tuple[str, ...] = ()


@dataclass(frozen=True)
class Send:
    """Send `items` of `type_url` (built lazily, batch by batch) and wait for each answer. Empty
    only to answer Envoy's first request of the type, which it waits for before asking more."""

    type_url: str
    items: Iterable[Item]


@dataclass(frozen=True)
class AwaitRequest:
    """Nothing can be sent before Envoy's next request: it has not subscribed `type_url` yet, or
    not the route configurations of `keys` (whose scopes it just took). Waiting too long for a
    type means the Envoy is behind; for routes, those maps are left to its later subscription."""

    type_url: str
    keys: frozenset[MapKey] = frozenset()


Step = Send | AwaitRequest


@dataclass
class EnvoyState:
    """What one Envoy holds, subscribed and refused, as its requests and answers said."""

    held: dict[str, dict[str, str]] = field(default_factory=lambda: {CLUSTER_TYPE: {}, SCOPE_TYPE: {}, ROUTE_TYPE: {}})
    clusters_of: dict[MapKey, set[str]] = field(default_factory=dict)
    subscribed: set[str] = field(default_factory=set)  # types Envoy asked for
    owed_first: set[str] = field(default_factory=set)  # types whose first request awaits an answer
    routes_wanted: set[str] = field(default_factory=set)  # RDS names Envoy subscribed
    dirty: set[MapKey] = field(default_factory=set)  # maps to bring to the target
    refused: dict[MapKey, tuple[MapResources | None, str]] = field(default_factory=dict)  # part -> Envoy's words

    # --- what Envoy told us --------------------------------------------------------------------------

    def over(self, request: discovery_pb2.DeltaDiscoveryRequest, cap: int) -> str | None:
        """Why taking `request` would keep more than `cap` names of its type for this stream (its
        listed versions, or its route subscriptions), or None: checked before anything is kept."""
        type_url = request.type_url
        if type_url not in KIND:
            return None
        listed = request.initial_resource_versions
        held = self.held[type_url]
        if len(held) + len(listed) > cap and len(held) + sum(1 for n in listed if n not in held) > cap:
            return f"more than {cap} {KIND[type_url]} names listed on one stream"
        if type_url == ROUTE_TYPE:
            wanted, subscribe = self.routes_wanted, request.resource_names_subscribe
            if len(wanted) + len(subscribe) > cap and len(wanted) + sum(1 for n in subscribe if n not in wanted) > cap:
                return f"more than {cap} route names subscribed on one stream"
        return None

    def receive(self, request: discovery_pb2.DeltaDiscoveryRequest, target: Iterable[MapKey]) -> None:
        """A request's subscriptions and listed versions (its answer to a response is the pump's)."""
        type_url = request.type_url
        if type_url not in KIND:
            return
        for name, version in request.initial_resource_versions.items():
            self.hold(type_url, name, version)
        if type_url not in self.subscribed:
            self.subscribed.add(type_url)
            if type_url != ROUTE_TYPE:
                self.owed_first.add(type_url)
            self.dirty.update(target)
            self.dirty.update(k for n in request.initial_resource_versions if (k := key_of(n)) is not None)
        if type_url == ROUTE_TYPE:
            for name in request.resource_names_subscribe:
                self.routes_wanted.add(name)
                if (key := key_of(name)) is not None:
                    self.dirty.add(key)
            for name in request.resource_names_unsubscribe:
                self.routes_wanted.discard(name)
                self.held[ROUTE_TYPE].pop(name, None)

    def hold(self, type_url: str, name: str, version: str | None) -> None:
        if version is None:
            self.held[type_url].pop(name, None)
        else:
            self.held[type_url][name] = version
        key = key_of(name)
        if type_url == CLUSTER_TYPE and key is not None:
            names = self.clusters_of.setdefault(key, set())
            if version is None:
                names.discard(name)
                if not names:
                    del self.clusters_of[key]
            else:
                names.add(name)

    def acknowledged(self, type_url: str, items: Iterable[Item]) -> None:
        for item in items:
            for resource in item.resources:
                self.hold(type_url, resource.name, resource.version)
            for name in item.removed:
                self.hold(type_url, name, None)

    # --- what it serves ------------------------------------------------------------------------------

    def holds(self, key: MapKey, part: MapResources | None) -> bool:
        """It acknowledged `part` of `key` (None: the map's withdrawal): scope, route configuration
        and every cluster, at their versions."""
        held = self.held
        if part is None:
            return map_name(key) not in held[SCOPE_TYPE] and key not in self.clusters_of
        if held[SCOPE_TYPE].get(part.scope.name) != part.scope.version or held[ROUTE_TYPE].get(part.route_config.name) != part.route_config.version:
            return False
        clusters = held[CLUSTER_TYPE]
        for cluster in part.clusters:  # a loop, not all(): a resync asks this of 10,000 maps per Envoy
            if clusters.get(cluster.name) != cluster.version:
                return False
        return True

    def refusal(self, key: MapKey, part: MapResources | None) -> str | None:
        """Its words, when it refused `part` of `key` as it is; else None."""
        refused = self.refused.get(key)
        if refused is None or not (refused[0] is part or refused[0] == part):
            return None
        return refused[1]

    def refusing(self, target: Mapping[MapKey, MapResources]) -> int:
        """How many maps it refuses as `target` has them now (it serves their older weights; a
        refused withdrawal is a refused None)."""
        return sum(1 for key in list(self.refused) if self.refusal(key, target.get(key)) is not None)

    def serves(self, key: MapKey) -> Route | None:
        """The route this Envoy serves for `key`: its scope, its route configuration and the map's
        cluster that routes to (none for a 503). A leftover cluster of an interrupted update (an
        older sidecar's cluster per backend) is no reason to say no."""
        name = map_name(key)
        if name not in self.held[SCOPE_TYPE]:
            return None
        return served_route(self.held[CLUSTER_TYPE].get(name), self.held[ROUTE_TYPE].get(name))

    def served_version(self, key: MapKey) -> str | None:
        """The digest of the version naming the route this Envoy serves for `key`; None: not served."""
        route = self.serves(key)
        if route is None:
            return None
        name = map_name(key)
        return (self.held[ROUTE_TYPE][name] if route.all_zero else self.held[CLUSTER_TYPE][name]).split(" ")[0]

    @property
    def readable(self) -> bool:
        """Envoy has listed what it holds: its cluster and scope requests came, and its route
        request too when it holds scopes."""
        types = {CLUSTER_TYPE, SCOPE_TYPE} | ({ROUTE_TYPE} if self.held[SCOPE_TYPE] else set())
        return types <= self.subscribed


def served_by_most(states: Iterable[EnvoyState], target: Mapping[MapKey, MapResources] | None = None) -> dict[MapKey, Route]:
    """Every map one of `states` serves, with the route most of them serve (a tie: the first's).
    An Envoy that refused a map's part in `target` (it holds older weights back) has no vote on it."""
    votes: dict[MapKey, list[Route]] = {}
    for state in states:
        add_votes(votes, state, state.held[SCOPE_TYPE], target)
    return most_voted(votes)


def add_votes(
    votes: dict[MapKey, list[Route]], state: EnvoyState, names: Iterable[str], target: Mapping[MapKey, MapResources] | None = None
) -> None:
    """One vote of `state` for the route it serves of each scope in `names` (served_by_most's
    step, so a caller can count 10,000 maps a slice at a time). An Envoy holding a map's part in
    `target` at its versions serves that part's route: nothing is parsed (a resync's read of
    10,000 maps took 60-280 ms when every one was)."""
    for name in names:
        key = key_of(name)
        if key is None:
            continue
        part = target.get(key) if target is not None else None
        if target is not None and state.refusal(key, part) is not None:
            continue
        route = part.route if part is not None and state.holds(key, part) else state.serves(key)
        if route is not None:
            votes.setdefault(key, []).append(route)


def most_voted(votes: Mapping[MapKey, list[Route]]) -> dict[MapKey, Route]:
    # Envoys nearly always agree: a map's routes are ranked only when they differ (10,000 maps: 3 ms, not 13).
    return {key: routes[0] if len(routes) == 1 or all(r == routes[0] for r in routes[1:]) else Counter(routes).most_common(1)[0][0] for key, routes in votes.items()}


def served_versions(key: MapKey, part: MapResources | None, envoys: Iterable[tuple[str, EnvoyState]]) -> dict[str, str | None]:
    """Pure: Envoy name -> the version of `key` it serves (None: not served), followed by its
    words when it refused `part`, the map's current part."""
    served: dict[str, str | None] = {}
    for name, state in envoys:
        version = state.served_version(key)
        refusal = state.refusal(key, part)
        served[name] = version if refusal is None else f"{version or 'nothing'}, holding back the current weights: {refusal}"
    return served


@dataclass(frozen=True)
class WriteAnswer:
    """One Envoy connected through a whole write, as the write's outcome reads it: its name (the
    instance label), its state, and whether it converged through the write (synced its generation)."""

    name: str
    state: EnvoyState
    synced: bool


def write_outcome(
    changes: Iterable[MapKey],
    before: Mapping[MapKey, MapResources | None],
    target: Mapping[MapKey, MapResources],
    answers: Sequence[WriteAnswer],
) -> tuple[dict[MapKey, str], dict[MapKey, str]]:
    """Pure: the maps of `changes` not every Envoy took, as (rejected, held back), each with its
    message: rejected (put back for all) when none took it, or when it moves or leaves its hostname
    (`before` has the part it had); held back on the refusers otherwise. An Envoy took a map when it
    converged through the write without refusing the map's part in `target`, or holds that part."""
    rejected: dict[MapKey, str] = {}
    held_back: dict[MapKey, str] = {}
    for key in changes:
        part = target.get(key)
        refusals: list[str] = []
        pending: list[str] = []
        took = 0
        for answer in answers:
            refusal = answer.state.refusal(key, part)
            if refusal is not None:
                refusals.append(refusal)
            elif answer.synced or answer.state.holds(key, part):
                took += 1
            else:
                pending.append(answer.name)
        if not refusals and not pending:
            continue
        old = before[key]
        if took and part is not None and (old is None or old.route.hostname == part.route.hostname):
            held_back[key] = fleet_message(refusals, pending, took)
        else:
            rejected[key] = fleet_message(refusals, pending, 0)
    return rejected, held_back


def plan(
    state: EnvoyState, target: Mapping[MapKey, MapResources], withdrawn: Set[MapKey], keys: Set[MapKey], *, seeded: bool = True
) -> Step | None:
    """The next step toward `target` for `keys` on this Envoy, or None when there is none.

    `target` and `withdrawn` are the parts the engine wrote and the maps it withdrew, as they were
    when this round began; a map in neither is left as the Envoy holds it, and so is one whose
    part it refused as it is. Before the first write (`seeded` false) only Envoy's first requests
    are answered, empty: the target is unknown, and nothing the Envoy holds changes."""
    if not seeded:
        owed = [type_url for type_url in (CLUSTER_TYPE, SCOPE_TYPE) if type_url in state.owed_first]
        return Send(owed[0], ()) if owed else None
    live = _live(state, target, withdrawn, keys)
    for type_url in (CLUSTER_TYPE, SCOPE_TYPE):
        if type_url not in state.subscribed:
            return AwaitRequest(type_url)
        step = _first_nonempty(type_url, _cluster_adds(state, target, live)) if type_url == CLUSTER_TYPE else _scope_step(state, target, live)
        if step is not None:
            return step
        if type_url in state.owed_first:
            return Send(type_url, ())
    held_routes = state.held[ROUTE_TYPE]
    # A route configuration Envoy holds no version of is not built to be compared, only to be sent.
    routes = [
        k for k in live
        if k in target and ((held := held_routes.get(map_name(k))) is None or held != target[k].route_config.version)
    ]
    if routes:
        unsubscribed = frozenset(k for k in routes if map_name(k) not in state.routes_wanted)
        if unsubscribed:
            return AwaitRequest(ROUTE_TYPE, unsubscribed)
        return Send(ROUTE_TYPE, (Item(k, target[k], (target[k].route_config,)) for k in routes))
    stale = []
    for key in live:
        part = target.get(key)
        keep = {r.name for r in part.clusters} if part is not None else set()
        removed = tuple(sorted(state.clusters_of.get(key, set()) - keep))
        if removed:
            stale.append(Item(key, part, removed=removed))
    return Send(CLUSTER_TYPE, stale) if stale else None


def _live(state: EnvoyState, target: Mapping[MapKey, MapResources], withdrawn: Set[MapKey], keys: Set[MapKey]) -> list[MapKey]:
    """`keys` the engine wrote or withdrew, less those whose part as it is this Envoy refused."""
    refused = state.refused
    return [
        k for k in sorted(keys)
        if (k in target or k in withdrawn) and not (k in refused and refused[k][0] == target.get(k))
    ]


def _cluster_adds(state: EnvoyState, target: Mapping[MapKey, MapResources], live: list[MapKey]) -> Iterator[Item]:
    """New and changed clusters, built only as they are taken (a first publish, batch by batch)."""
    held = state.held[CLUSTER_TYPE]
    for key in live:
        part = target.get(key)
        if part is not None:
            changed = tuple(r for r in part.clusters if held.get(r.name) != r.version)
            if changed:
                yield Item(key, part, changed)


def _scope_step(state: EnvoyState, target: Mapping[MapKey, MapResources], live: list[MapKey]) -> Send | None:
    """Scopes of withdrawn maps leave first, so their host is free for another map's scope; then
    new and changed scopes."""
    held = state.held[SCOPE_TYPE]
    gone = [Item(k, None, removed=(map_name(k),)) for k in live if k not in target and map_name(k) in held]
    if gone:
        return Send(SCOPE_TYPE, gone)
    scopes = [Item(k, target[k], (target[k].scope,)) for k in live if k in target and held.get(target[k].scope.name) != target[k].scope.version]
    return Send(SCOPE_TYPE, scopes) if scopes else None


def _first_nonempty(type_url: str, items: Iterator[Item]) -> Send | None:
    first = next(items, None)
    if first is None:
        return None
    return Send(type_url, _prepend(first, items))


def _prepend(first: Item, rest: Iterator[Item]) -> Iterator[Item]:
    yield first
    yield from rest
