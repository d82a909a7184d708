"""The sidecar's one condition on each TrafficMap (SPEC §5).

`condition_for` is pure: from what happened to a map and the condition it already carries, the
condition to apply, or None when it would change nothing (so a restart writes nothing new).
`write_condition` sends only that condition by server-side apply on the status subresource, with
the instance's own field manager, so OME's conditions and fields are never touched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from publisher.kube import TRAFFIC_MAPS, Kube
from publisher.model import API_VERSION, TRAFFIC_MAP_KIND, Condition, MapKey, Reason

CONDITION_PREFIX = "gateway-publisher.ome.io/"
FIELD_MANAGER_PREFIX = "ome-gateway-publisher-"
# metav1.Condition's validation: reason pattern and message length.
_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
_MAX_MESSAGE = 32768


def condition_type(instance: str) -> str:
    return CONDITION_PREFIX + instance


def field_manager(instance: str) -> str:
    return FIELD_MANAGER_PREFIX + instance


@dataclass(frozen=True, slots=True)
class Report:
    """What the gateway holds for a map, as its condition will say it."""

    published: bool
    reason: Reason
    message: str
    generation: int


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition_for(report: Report, instance: str, existing: Condition | None, now: datetime) -> dict[str, Any] | None:
    """The condition to apply, or None when `existing` already says the same.
    lastTransitionTime moves only when status changes."""
    status = "True" if report.published else "False"
    reason = str(report.reason)
    if not _REASON.match(reason):
        raise ValueError(f"reason {reason!r} is not a valid condition reason")
    message = report.message[:_MAX_MESSAGE]
    if (
        existing is not None
        and existing.status == status
        and existing.reason == reason
        and existing.message == message
        and existing.observed_generation == report.generation
    ):
        return None
    transition = existing.last_transition_time if existing is not None and existing.status == status and existing.last_transition_time else rfc3339(now)
    return {
        "type": condition_type(instance),
        "status": status,
        "reason": reason,
        "message": message,
        "observedGeneration": report.generation,
        "lastTransitionTime": transition,
    }


async def write_condition(kube: Kube, key: MapKey, condition: dict[str, Any], instance: str) -> None:
    """Server-side apply of this one condition to trafficmaps/status. Raises KubeError."""
    body = {
        "apiVersion": API_VERSION,
        "kind": TRAFFIC_MAP_KIND,
        "metadata": {"name": key.name, "namespace": key.namespace},
        "status": {"conditions": [condition]},
    }
    await kube.apply(TRAFFIC_MAPS, body, field_manager=field_manager(instance), subresource="status")
