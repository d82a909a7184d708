"""The /debug/maps view: per map, what the loop decided and what the gateway serves.

Pure: owns nothing; reads what the loop's parts own, as the loop hands it over.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any

from publisher.core.model import InvalidObject, TrafficMap

from publisher.core.values import MapKey, Publication, Route
from publisher.loop.states import MapStates
from publisher.split import check as split_check
from publisher.split.check import SplitVerifier


def debug_maps(
    keys: Iterable[MapKey],
    *,
    states: MapStates,
    published: Mapping[MapKey, Route],
    provenance: Mapping[MapKey, Publication],
    objects: Callable[[MapKey], TrafficMap | InvalidObject | None],
    wall_clock: Callable[[], datetime],
    adapter_name: str,
    served_by: Callable[[MapKey], Any] | None,
    split: SplitVerifier | None,
) -> list[dict[str, Any]]:
    """One entry per key, in key order. `objects` looks a map up in the source's store;
    `served_by` says which version each connected Envoy serves (None: not an Envoy fleet)."""
    maps = []
    for key in sorted(keys):
        state = states.state(key)
        route = published.get(key)
        pub = provenance.get(key) if route is not None else None
        maps.append(
            {
                "namespace": key.namespace,
                "name": key.name,
                "decision": state.state,
                "reason": state.reason,
                "message": state.message,
                "publishedGeneration": pub.generation if pub else None,
                "hostname": route.hostname if route else None,
                "weights": {b.cluster: b.weight for b in route.backends} if route else None,
                "probeAgeSeconds": probe_ages(objects(key), wall_clock()),
            }
        )
        if served_by is not None:
            maps[-1]["envoys"] = served_by(key)  # which version each connected Envoy serves
        maps[-1]["split"] = split.debug(key) if split is not None else split_check.unsupported(adapter_name)
    return maps


def probe_ages(item: TrafficMap | InvalidObject | None, now: datetime) -> dict[str, int] | None:
    """Seconds since each cluster's last probe: the ticking number conditions must not carry."""
    if not isinstance(item, TrafficMap):
        return None
    ages = {}
    for entry in item.spec.entries:
        if entry.probe is not None and entry.probe.last_probe_time:
            try:
                probed = datetime.fromisoformat(entry.probe.last_probe_time.replace("Z", "+00:00"))
            except ValueError:
                continue
            ages[entry.cluster] = round((now - probed).total_seconds())
    return ages or None
