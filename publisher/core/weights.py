"""SPEC section 3: the weights OME should have written, recomputed from a map's entries alone.

Pure integer arithmetic over validated entries (model.Entry); factors are exact thousandths from
`quantity`. This module decides nothing about whether a map may be published: `verify` compares,
`gate` decides. No I/O, no logging.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from publisher.core.model import MAX_WEIGHT, Entry, TrafficMap
from publisher.core.quantity import milli_ceil, parse_quantity

__all__ = ["expected_healthy", "factor_milli", "gated", "preserves_traffic", "recompute", "recompute_map", "routable"]

# A factor that is absent, zero or negative counts as 1 (SPEC §3 step 3).
DEFAULT_FACTOR_MILLI = 1000
ROUTABLE = "Routable"
ALL_HOMES_PROBE_FAILED = "AllHomesProbeFailed"


def routable(entry: Entry) -> int:
    """Replicas that can serve: the lower of allocated and ready, never below 0."""
    return max(0, min(entry.capacity.allocated, entry.capacity.ready))


def gated(entry: Entry) -> bool:
    return entry.probe is not None and entry.probe.gated


def factor_milli(entry: Entry) -> int:
    """The capacity factor in whole thousandths, rounded up; 1000 when absent, zero or negative."""
    if entry.capacity.factor is None:
        return DEFAULT_FACTOR_MILLI
    milli = milli_ceil(parse_quantity(entry.capacity.factor))
    return milli if milli > 0 else DEFAULT_FACTOR_MILLI


def expected_healthy(entry: Entry) -> bool:
    """What `healthy` must say: some replica is ready and the probe does not gate the entry."""
    return entry.capacity.ready > 0 and not gated(entry)


def preserves_traffic(tm: TrafficMap) -> bool:
    """OME kept the weights although every home failed its probe (policy PreserveTraffic)."""
    condition = tm.status.condition(ROUTABLE)
    return condition is not None and condition.status == "True" and condition.reason == ALL_HOMES_PROBE_FAILED


def recompute(entries: Sequence[Entry], *, preserve_traffic: bool) -> tuple[int, ...]:
    """The weights of `entries`, in their order, as SPEC §3 computes them.

    The seed's table: worker-a 4 replicas, worker-b 2 with factor "3" -> (2, 3).
    `preserve_traffic` comes from `preserves_traffic(tm)`; `recompute_map` passes it for you.
    """
    raw = [0 if gated(entry) else routable(entry) * factor_milli(entry) for entry in entries]
    if preserve_traffic and not any(raw) and all(gated(entry) for entry in entries):
        raw = [routable(entry) * factor_milli(entry) for entry in entries]
    divisor = math.gcd(*raw)
    if divisor:
        raw = [value // divisor for value in raw]
    largest = max(raw, default=0)
    if largest > MAX_WEIGHT:
        # Ceiling division: the largest lands exactly on the cap and no positive weight becomes 0.
        raw = [-(-value * MAX_WEIGHT // largest) for value in raw]
    return tuple(0 if entry.drain_refs else value for entry, value in zip(entries, raw, strict=True))


def recompute_map(tm: TrafficMap) -> tuple[int, ...]:
    """`recompute` for a whole map, reading PreserveTraffic from its Routable condition."""
    return recompute(tm.spec.entries, preserve_traffic=preserves_traffic(tm))
