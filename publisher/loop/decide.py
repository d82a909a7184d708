"""Deciding a map from the newest objects (gate -> verify -> plan), and what one pass hands the engine.

`decide` is pure: it reads the Stores and the adapter's own pure check and writes nothing.
`Decisions` owns the outcomes kept per map, reused while the map's objects are the same.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from publisher.core import gate, plan
from publisher.core.model import InferenceService, InvalidObject, TrafficMap
from publisher.core.values import Held, MapKey, Publication, Route
from publisher.core.plan import Hold, Outcome, Publish, Withdraw
from publisher.loop.options import LoopOptions
from publisher.source.store import Stores


def decide(key: MapKey, stores: Stores, options: LoopOptions, check: Callable[[Publication], Held | None]) -> Outcome:
    """The map's outcome from the newest TrafficMap and InferenceService; `check` is the adapter's
    own (a hostname it cannot serve, say)."""
    item, isvc = _objects(key, stores)
    return _decide(item, isvc, options, check)


def _objects(key: MapKey, stores: Stores) -> tuple[TrafficMap | InvalidObject | None, InferenceService | None]:
    """The map and the InferenceService its spec.service names, in the map's namespace."""
    item = stores.maps.get(key)
    service = item.spec.service if isinstance(item, TrafficMap) else key.name
    return item, stores.isvcs.get(MapKey(key.namespace, service))


def _decide(
    item: TrafficMap | InvalidObject | None, isvc: InferenceService | None, options: LoopOptions, check: Callable[[Publication], Held | None]
) -> Outcome:
    if isinstance(item, InvalidObject):
        if item.deletion_timestamp is not None:
            # Invalid or not, a map being deleted leaves the gateway.
            return Withdraw(f"the TrafficMap is being deleted (since {item.deletion_timestamp})")
        held = gate.decide(item, isvc, options.gate)
        assert held is not None
        return Hold(held)
    reason = plan.withdrawal(item, isvc)
    if reason is not None:
        return Withdraw(reason)
    assert isinstance(item, TrafficMap)
    held = gate.decide(item, isvc, options.gate)
    if held is not None:
        return Hold(held)
    publication = plan.publication_for(item, isvc, options.host_template)
    held = check(publication)
    return Hold(held) if held is not None else Publish(publication)


class Decisions:
    """Each map's outcome, kept with what it was decided from. `decide` is a function of the map,
    its InferenceService, the options and the adapter's pure check alone (no clock), and the
    Stores hold an object until an event replaces it: while the map's revision (which the echo of
    our own condition leaves alone) and the InferenceService object are the ones kept, the kept
    outcome is the decision. A resync's re-decide of 10,000 unchanged maps is then a lookup each
    (it was a gate, a verify and a plan each: 0.5-0.8 s of CPU a minute)."""

    def __init__(self, stores: Stores, options: LoopOptions, check: Callable[[Publication], Held | None]) -> None:
        self._stores = stores
        self._options = options
        self._check = check
        self._kept: dict[MapKey, tuple[int, InferenceService | None, Outcome]] = {}

    def __call__(self, key: MapKey) -> Outcome:
        item, isvc = _objects(key, self._stores)
        revision = self._stores.maps.revision(key)
        kept = self._kept.get(key)
        if kept is not None and kept[0] == revision and kept[1] is isvc:
            return kept[2]
        outcome = _decide(item, isvc, self._options, self._check)
        if revision is None:
            self._kept.pop(key, None)
        else:
            self._kept[key] = (revision, isvc, outcome)
        return outcome


@dataclass(frozen=True)
class Batch:
    """What one pass hands the engine in one apply."""

    # Every Publish and Withdraw of the pass: the engine writes only what differs from what it
    # confirmed, and also what a client refused or two maps serve on one hostname.
    decided: Mapping[MapKey, Publication | None]
    # What the engine had confirmed for each of them before this apply.
    before: Mapping[MapKey, Route | None]
    # What a failed write leaves failed (or pending): the maps it would have changed, and the maps
    # that were failing already (a refusal is retried by writing the same route again).
    changes: frozenset[MapKey]


def engine_batch(outcomes: Mapping[MapKey, Outcome], confirmed: Mapping[MapKey, Route], failing: Callable[[MapKey], bool]) -> Batch:
    """The pass's batch: `confirmed` is what the engine serves now, `failing` says which maps' last
    write failed."""
    decided: dict[MapKey, Publication | None] = {}
    for key, outcome in outcomes.items():
        if isinstance(outcome, Publish):
            decided[key] = outcome.publication
        elif isinstance(outcome, Withdraw):
            decided[key] = None
    before = {key: confirmed.get(key) for key in decided}
    changes = frozenset(
        key for key, pub in decided.items()
        if (pub.route if pub is not None else None) != before[key] or failing(key)
    )
    return Batch(decided, before, changes)
