"""Our own values that travel between stages: the key of a map, why one is held, what a gateway is
asked to serve, and the name of each region's condition on a map."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NamedTuple


class Reason(StrEnum):
    """Every reason code, spelled as in SPEC: gates (§4), and the sidecar's own condition (§5)."""

    INVALID_MAP = "InvalidMap"
    SOURCE_MISSING = "SourceMissing"
    SOURCE_UID_MISMATCH = "SourceUIDMismatch"
    ISVC_GENERATION_MISMATCH = "ISVCGenerationMismatch"
    ROUTABLE_OUTDATED = "RoutableOutdated"
    NOT_PUBLISHED_BY_OME = "NotPublishedByOME"
    VERIFICATION_FAILED = "VerificationFailed"
    INVALID_PLAN = "InvalidPlan"
    HOST_CONFLICT = "HostConflict"
    INTERNAL_ERROR = "InternalError"
    CLAIM_REJECTED = "ClaimRejected"
    APPLY_FAILED = "ApplyFailed"
    PUBLISHED = "Published"
    WITHDRAWN = "Withdrawn"


@dataclass(frozen=True, slots=True)
class Held:
    """A map that must not be published now. `message` names the field and both values."""

    reason: Reason
    message: str


class MapKey(NamedTuple):
    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class Backend:
    cluster: str
    endpoint: str
    weight: int


@dataclass(frozen=True, slots=True)
class Route:
    """What a gateway serves for one map: the data-plane part of a Publication, and all a gateway
    is ever given. Generations are provenance: they live in the sidecar's record and the status
    condition, never in gateway configuration, so a generation-only change writes nothing."""

    hostname: str
    backends: tuple[Backend, ...]

    @property
    def all_zero(self) -> bool:
        """No backend may get requests: the gateway answers 503 for this host."""
        return not any(b.weight for b in self.backends)


@dataclass(frozen=True, slots=True)
class Publication:
    """What one map asks of a gateway: adapter-neutral, backends in cluster order.

    `created` is the TrafficMap's creationTimestamp (RFC 3339, so it sorts as text): the older
    claim on a hostname keeps it when two maps ask for the same one."""

    namespace: str
    name: str
    hostname: str
    generation: int
    observed_isvc_generation: int
    backends: tuple[Backend, ...]
    created: str = ""

    @property
    def key(self) -> MapKey:
        return MapKey(self.namespace, self.name)

    @property
    def route(self) -> Route:
        return Route(self.hostname, self.backends)

    @property
    def all_zero(self) -> bool:
        """No backend may get requests: the gateway answers 503 for this host."""
        return not any(b.weight for b in self.backends)

    def to_json(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "name": self.name,
            "hostname": self.hostname,
            "generation": self.generation,
            "observedISVCGeneration": self.observed_isvc_generation,
            "backends": [
                {"cluster": b.cluster, "endpoint": b.endpoint, "weight": b.weight} for b in self.backends
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Publication:
        """Reads back what an adapter wrote; raises ValueError on anything it did not write."""
        try:
            return cls(
                namespace=str(data["namespace"]),
                name=str(data["name"]),
                hostname=str(data["hostname"]),
                generation=int(data["generation"]),
                observed_isvc_generation=int(data["observedISVCGeneration"]),
                backends=tuple(
                    Backend(cluster=str(b["cluster"]), endpoint=str(b["endpoint"]), weight=int(b["weight"]))
                    for b in data["backends"]
                ),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a publication: {exc!r}") from exc


# Each region's condition on a TrafficMap has the type CONDITION_PREFIX + region (the status
# writer sets its own; the source and the fleet view read the other regions').
CONDITION_PREFIX = "gateway-publisher.ome.io/"


def condition_type(instance: str) -> str:
    return CONDITION_PREFIX + instance
