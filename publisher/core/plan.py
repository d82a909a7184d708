"""From a decided map to what the gateway should hold.

Pure: `publication_for` builds the adapter-neutral Publication of a map that passed its gates,
`withdrawal` says when a map must leave the gateway, `Outcome` is what the loop decided per map,
and `desired_for` keeps a held map's last publication. No I/O, no logging.
"""

from __future__ import annotations

from dataclasses import dataclass

from publisher.core.model import GLOBAL_HOST_ANNOTATION, InferenceService, TrafficMap
from publisher.core.values import Backend, Held, Publication

DEFAULT_HOST_TEMPLATE = "{name}.{namespace}"


def hostname_for(tm: TrafficMap, isvc: InferenceService | None, host_template: str) -> str:
    """The InferenceService's `ome.io/global-host` when set, else the template on the map's name."""
    if isvc is not None:
        host = isvc.metadata.annotations.get(GLOBAL_HOST_ANNOTATION, "").strip()
        if host:
            return host
    return host_template.format(name=tm.metadata.name, namespace=tm.metadata.namespace)


def publication_for(tm: TrafficMap, isvc: InferenceService | None, host_template: str) -> Publication:
    return Publication(
        namespace=tm.metadata.namespace,
        name=tm.metadata.name,
        hostname=hostname_for(tm, isvc, host_template),
        generation=tm.metadata.generation,
        observed_isvc_generation=tm.spec.observed_isvc_generation,
        backends=tuple(
            Backend(cluster=e.cluster, endpoint=e.endpoint, weight=e.weight)
            for e in sorted(tm.spec.entries, key=lambda e: e.cluster)
        ),
        created=tm.metadata.creation_timestamp,
    )


def withdrawal(tm: TrafficMap | None, isvc: InferenceService | None) -> str | None:
    """Why the map's route leaves the gateway, or None when it stays. Not a gate: a map being
    deleted or opted out is not held, it is withdrawn."""
    if tm is None:
        return "the TrafficMap no longer exists"
    if tm.metadata.deletion_timestamp is not None:
        return f"the TrafficMap is being deleted (since {tm.metadata.deletion_timestamp})"
    if isvc is not None and isvc.deleting:
        return f"InferenceService {isvc.key} is being deleted"
    if isvc is not None and isvc.opted_out:
        return f"InferenceService {isvc.key} has spec.routing.enabled false"
    return None


@dataclass(frozen=True, slots=True)
class Publish:
    publication: Publication


@dataclass(frozen=True, slots=True)
class Hold:
    held: Held


@dataclass(frozen=True, slots=True)
class Withdraw:
    message: str


Outcome = Publish | Hold | Withdraw


def desired_for(outcome: Outcome, last_published: Publication | None) -> Publication | None:
    """What the gateway should hold for one map: a held map keeps exactly what it had."""
    if isinstance(outcome, Publish):
        return outcome.publication
    if isinstance(outcome, Hold):
        return last_published
    return None
