"""SPEC section 4: whether a map may be published now, from the map and its InferenceService alone.

`decide` runs the gates in SPEC order and returns the first Held, or None. It covers every gate
that needs no gateway (InvalidPlan is the adapter's `check`). Withdrawal (a map or InferenceService
being deleted, an opted-out service) is the planner's, not a gate. Pure: no I/O, no logging.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from publisher.core.model import INFERENCE_SERVICE_KIND, InferenceService, InvalidObject, TrafficMap
from publisher.core.values import Held, Reason
from publisher.core.verify import verify

__all__ = ["GateOptions", "PublishedGate", "decide", "describe_invalid"]

PUBLISHED = "Published"
ROUTABLE = "Routable"
WITHDRAWN = "Withdrawn"


class PublishedGate(StrEnum):
    """How far to trust OME's own `Published` condition (flag --ome-published-gate)."""

    AUTO = "auto"
    REQUIRE = "require"
    IGNORE = "ignore"


@dataclass(frozen=True, slots=True)
class GateOptions:
    """`source_known=False`: the caller cannot know the InferenceService (the verify command without
    it in its input), so SourceMissing, SourceUIDMismatch and ISVCGenerationMismatch are skipped."""

    published_gate: PublishedGate = PublishedGate.AUTO
    source_known: bool = True


def decide(item: TrafficMap | InvalidObject, isvc: InferenceService | None, options: GateOptions) -> Held | None:
    """The first gate that holds the map, in SPEC order, or None when it may be published."""
    if isinstance(item, InvalidObject):
        return Held(Reason.INVALID_MAP, describe_invalid(item))
    tm = item
    if options.source_known:
        if isvc is None:
            return Held(
                Reason.SOURCE_MISSING,
                f"InferenceService {tm.metadata.namespace}/{tm.spec.service} (spec.service) not found",
            )
        held = _source_uid(tm, isvc) or _isvc_generation(tm, isvc)
        if held is not None:
            return held
    return _routable(tm) or _published(tm, options.published_gate) or verify(tm)


def describe_invalid(item: InvalidObject) -> str:
    """The validation message with entry indexes replaced by cluster names where the raw map has
    them: `spec.entries[worker-b].weight: ...` instead of `spec.entries[1].weight: ...`."""
    entries = _raw_entries(item.raw)

    def cluster_of(match: re.Match[str]) -> str:
        index = int(match[1])
        cluster = entries[index].get("cluster") if index < len(entries) and isinstance(entries[index], dict) else None
        return f"spec.entries[{cluster}]" if isinstance(cluster, str) and _PLAIN.fullmatch(cluster) else match[0]

    return _ENTRY_INDEX.sub(cluster_of, item.message.replace("Value error, ", ""))


_ENTRY_INDEX = re.compile(r"spec\.entries\[(\d+)\]")
# Only names that cannot be mistaken for message syntax replace an index.
_PLAIN = re.compile(r"[A-Za-z0-9._-]{1,253}")


def _raw_entries(raw: dict[str, Any]) -> Sequence[Any]:
    spec = raw.get("spec")
    entries = spec.get("entries") if isinstance(spec, dict) else None
    return entries if isinstance(entries, (list, tuple)) else ()


def _source_uid(tm: TrafficMap, isvc: InferenceService) -> Held | None:
    uid = isvc.metadata.uid
    source = f"InferenceService {isvc.metadata.namespace}/{isvc.metadata.name}"
    if not tm.status.source_uid:
        return Held(Reason.SOURCE_UID_MISMATCH, f"status.sourceUID is empty, {source} has uid {uid}")
    if tm.status.source_uid != uid:
        return Held(
            Reason.SOURCE_UID_MISMATCH, f"status.sourceUID is {tm.status.source_uid}, {source} has uid {uid}"
        )
    for owner in tm.metadata.owner_references:
        if owner.controller and owner.kind == INFERENCE_SERVICE_KIND and owner.uid != uid:
            return Held(
                Reason.SOURCE_UID_MISMATCH,
                f"metadata.ownerReferences[{owner.name}].uid is {owner.uid}, {source} has uid {uid}",
            )
    return None


def _isvc_generation(tm: TrafficMap, isvc: InferenceService) -> Held | None:
    observed, generation = tm.spec.observed_isvc_generation, isvc.metadata.generation
    if observed == generation:
        return None
    return Held(
        Reason.ISVC_GENERATION_MISMATCH,
        f"spec.observedISVCGeneration is {observed}, InferenceService "
        f"{isvc.metadata.namespace}/{isvc.metadata.name} metadata.generation is {generation}",
    )


def _routable(tm: TrafficMap) -> Held | None:
    condition = tm.status.condition(ROUTABLE)
    generation = tm.metadata.generation
    if condition is None:
        return Held(
            Reason.ROUTABLE_OUTDATED, f"status.conditions[Routable] is missing, metadata.generation is {generation}"
        )
    if condition.observed_generation != generation:
        return Held(
            Reason.ROUTABLE_OUTDATED,
            f"status.conditions[Routable].observedGeneration is {_unset(condition.observed_generation)}, "
            f"metadata.generation is {generation}",
        )
    return None


def _published(tm: TrafficMap, mode: PublishedGate) -> Held | None:
    if mode is PublishedGate.IGNORE:
        return None
    condition = tm.status.condition(PUBLISHED)
    generation = tm.metadata.generation
    if condition is None:
        if mode is PublishedGate.AUTO:
            return None
        return Held(
            Reason.NOT_PUBLISHED_BY_OME,
            f"status.conditions[Published] is missing, --ome-published-gate={mode} needs it True "
            f"at generation {generation}",
        )
    if mode is PublishedGate.AUTO and condition.status == "False" and condition.reason == WITHDRAWN:
        return None
    if condition.status != "True":
        detail = f": {condition.message}" if condition.message else ""
        return Held(
            Reason.NOT_PUBLISHED_BY_OME,
            f"status.conditions[Published] is {condition.status} with reason {condition.reason or '<none>'}"
            f"{detail}",
        )
    observed_map = tm.status.observed_traffic_map_generation
    if condition.observed_generation != generation or observed_map != generation:
        return Held(
            Reason.NOT_PUBLISHED_BY_OME,
            f"status.conditions[Published].observedGeneration is {_unset(condition.observed_generation)} and "
            f"status.observedTrafficMapGeneration is {_unset(observed_map)}, metadata.generation is {generation}",
        )
    return None


def _unset(value: int | None) -> str:
    return "unset" if value is None else str(value)


def stalled_probes(tm: TrafficMap, max_age: float, now: datetime) -> str | None:
    """Entries whose prober has not reported within `max_age` seconds: reported, never held (a
    stalled prober says nothing about the backends, and holding would freeze every weight)."""
    stalled = []
    for entry in tm.spec.entries:
        if entry.probe is None or not entry.probe.last_probe_time:
            continue
        try:
            probed = datetime.fromisoformat(entry.probe.last_probe_time.replace("Z", "+00:00"))
        except ValueError:
            stalled.append(f"{entry.cluster} (unreadable lastProbeTime {entry.probe.last_probe_time!r})")
            continue
        if (now - probed).total_seconds() > max_age:
            stalled.append(entry.cluster)
    # No age in the text: it lands in a condition, which must change only when its meaning does.
    return f"probe results older than {max_age:g}s for " + ", ".join(stalled) if stalled else None
