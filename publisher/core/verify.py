"""Verification: the map's weights and `healthy` flags against what `weights` recomputes.

`compare` gives one row per entry (what the CLI prints); `verify` turns the first difference into
Held(VerificationFailed). Pure: no I/O, no logging.
"""

from __future__ import annotations

from dataclasses import dataclass

from publisher.core.model import TrafficMap
from publisher.core.values import Held, Reason
from publisher.core.quantity import canonical, parse_quantity
from publisher.core.weights import expected_healthy, recompute_map

__all__ = ["EntryCheck", "compare", "verify"]


@dataclass(frozen=True, slots=True)
class EntryCheck:
    """One entry as the map states it beside what it should state."""

    cluster: str
    allocated: int
    ready: int
    factor: str | None  # canonical form, None when the entry sets no factor
    weight: int
    expected: int
    healthy: bool
    expected_healthy: bool

    @property
    def ok(self) -> bool:
        return self.weight == self.expected and self.healthy == self.expected_healthy


def compare(tm: TrafficMap) -> tuple[EntryCheck, ...]:
    """Every entry of `tm`, in map order, with its recomputed weight and healthy flag."""
    expected = recompute_map(tm)
    return tuple(
        EntryCheck(
            cluster=entry.cluster,
            allocated=entry.capacity.allocated,
            ready=entry.capacity.ready,
            factor=None if entry.capacity.factor is None else canonical(parse_quantity(entry.capacity.factor)),
            weight=entry.weight,
            expected=weight,
            healthy=entry.healthy,
            expected_healthy=expected_healthy(entry),
        )
        for entry, weight in zip(tm.spec.entries, expected, strict=True)
    )


def verify(tm: TrafficMap) -> Held | None:
    """Held(VerificationFailed) naming the first entry whose weight or healthy differs, else None."""
    # Runs on every map event, so it skips the display work `compare` does.
    for entry, weight in zip(tm.spec.entries, recompute_map(tm), strict=True):
        if entry.weight != weight:
            return Held(
                Reason.VERIFICATION_FAILED, f"entries[{entry.cluster}].weight is {entry.weight}, recomputed {weight}"
            )
        healthy = expected_healthy(entry)
        if entry.healthy != healthy:
            return Held(
                Reason.VERIFICATION_FAILED,
                f"entries[{entry.cluster}].healthy is {_bool(entry.healthy)}, recomputed {_bool(healthy)}",
            )
    return None


def _bool(value: bool) -> str:
    return "true" if value else "false"
