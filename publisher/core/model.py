"""The input's shape: the TrafficMap and InferenceService as we read them.

Pydantic dataclasses, strict: a wrong type is refused with the field path; unknown fields are
ignored. `parse_traffic_map` turns a raw object into a TrafficMap or an InvalidObject that keeps
its key and the reason, so the map is held InvalidMap, not dropped. Our own values (MapKey, Reason,
Publication, ...) are in `values`, the checks of endpoints and names in `addresses`.
Imports nothing of ours but `quantity`, `addresses` and `values` (tests/test_layering.py); no I/O.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
    model_validator,
)
from pydantic.dataclasses import dataclass as pydantic_dataclass

from publisher.core.addresses import is_dns_subdomain, parse_endpoint
from publisher.core.quantity import QuantityError, parse_quantity
from publisher.core.values import MapKey

MAX_WEIGHT = 1_000_000
T = TypeVar("T")


# --- The TrafficMap and InferenceService as pydantic models ----------------------------------------


def _cluster_name(value: str) -> str:
    if not is_dns_subdomain(value):
        raise ValueError(f"{value!r} is not a DNS-1123 subdomain")
    return value


def _endpoint_url(value: str) -> str:
    parse_endpoint(value)
    return value


def _quantity(value: str) -> str:
    try:
        parse_quantity(value)
    except QuantityError as exc:
        raise ValueError(str(exc)) from exc
    return value


# Pydantic dataclasses with slots: validated like models, but about a fifth of a BaseModel's memory
# per object, which matters at 10,000 maps held for the life of the process. Every field is strict
# on its own (Strict*), and unknown fields are ignored: older and newer maps both parse.
_INPUT = ConfigDict(extra="ignore", populate_by_name=True)


def _input(cls: type[T]) -> type[T]:
    return pydantic_dataclass(frozen=True, slots=True, config=_INPUT)(cls)


@_input
class OwnerReference:
    api_version: StrictStr = Field(default="", alias="apiVersion")
    kind: StrictStr = ""
    name: StrictStr = ""
    uid: StrictStr = ""
    controller: StrictBool = False


@_input
class ObjectMeta:
    name: StrictStr
    namespace: StrictStr = "default"
    uid: StrictStr = ""
    generation: StrictInt = 0
    resource_version: StrictStr = Field(default="", alias="resourceVersion")
    creation_timestamp: StrictStr = Field(default="", alias="creationTimestamp")
    deletion_timestamp: StrictStr | None = Field(default=None, alias="deletionTimestamp")
    annotations: dict[StrictStr, StrictStr] = Field(default_factory=dict)
    owner_references: list[OwnerReference] = Field(default_factory=list, alias="ownerReferences")

    @property
    def key(self) -> MapKey:
        return MapKey(self.namespace, self.name)


@_input
class Condition:
    """A metav1.Condition as it appears on the map."""

    type: StrictStr
    status: Literal["True", "False", "Unknown"]
    reason: StrictStr = ""
    message: StrictStr = ""
    observed_generation: StrictInt | None = Field(default=None, alias="observedGeneration")
    last_transition_time: StrictStr = Field(default="", alias="lastTransitionTime")


@_input
class Capacity:
    allocated: StrictInt = 0
    ready: StrictInt = 0
    factor: Annotated[StrictStr, AfterValidator(_quantity)] | None = None
    source: StrictStr | None = None
    reported: StrictInt | None = None
    fallback_reason: StrictStr | None = Field(default=None, alias="fallbackReason")


@_input
class Probe:
    result: StrictStr | None = None
    gated: StrictBool = False
    last_probe_time: StrictStr | None = Field(default=None, alias="lastProbeTime")
    consecutive_failures: StrictInt | None = Field(default=None, alias="consecutiveFailures")
    message: StrictStr | None = None
    policy_digest: StrictStr | None = Field(default=None, alias="policyDigest")


@_input
class Entry:
    cluster: Annotated[StrictStr, AfterValidator(_cluster_name)]
    endpoint: Annotated[StrictStr, AfterValidator(_endpoint_url)]
    weight: Annotated[StrictInt, Field(ge=0, le=MAX_WEIGHT)]
    healthy: StrictBool
    capacity: Capacity = Field(default_factory=Capacity)
    probe: Probe | None = None
    drain_refs: list[StrictStr] = Field(default_factory=list, alias="drainRefs")


@_input
class TrafficMapSpec:
    service: StrictStr
    observed_isvc_generation: StrictInt = Field(alias="observedISVCGeneration")
    mode: StrictStr | None = None
    entries: list[Entry] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_clusters(self) -> TrafficMapSpec:
        seen: set[str] = set()
        for entry in self.entries:
            if entry.cluster in seen:
                raise ValueError(f"entries: duplicate cluster {entry.cluster!r}")
            seen.add(entry.cluster)
        return self


@_input
class TrafficMapStatus:
    source_uid: StrictStr = Field(default="", alias="sourceUID")
    observed_traffic_map_generation: StrictInt | None = Field(default=None, alias="observedTrafficMapGeneration")
    conditions: list[Condition] = Field(default_factory=list)

    def condition(self, type_: str) -> Condition | None:
        for condition in self.conditions:
            if condition.type == type_:
                return condition
        return None


@_input
class TrafficMap:
    metadata: ObjectMeta
    spec: TrafficMapSpec
    status: TrafficMapStatus = Field(default_factory=TrafficMapStatus)

    @property
    def key(self) -> MapKey:
        return self.metadata.key


@_input
class RoutingSpec:
    enabled: StrictBool | None = None
    capacity_factors: dict[StrictStr, StrictStr] = Field(default_factory=dict, alias="capacityFactors")


@_input
class InferenceServiceSpec:
    routing: RoutingSpec = Field(default_factory=RoutingSpec)


@_input
class InferenceService:
    """Only the InferenceService fields the gates and the plan read."""

    metadata: ObjectMeta
    spec: InferenceServiceSpec = Field(default_factory=InferenceServiceSpec)

    @property
    def key(self) -> MapKey:
        return self.metadata.key

    @property
    def opted_out(self) -> bool:
        return self.spec.routing.enabled is False

    @property
    def deleting(self) -> bool:
        return self.metadata.deletion_timestamp is not None


@functools.cache
def _adapter(cls: type[Any]) -> TypeAdapter[Any]:
    return TypeAdapter(cls)


def validate(cls: type[T], raw: Any) -> T:
    """`raw` (decoded JSON or YAML) as an instance of one of the input types; raises ValidationError."""
    result: T = _adapter(cls).validate_python(raw)
    return result


GLOBAL_HOST_ANNOTATION = "ome.io/global-host"
TRAFFIC_MAP_KIND = "TrafficMap"
INFERENCE_SERVICE_KIND = "InferenceService"
API_VERSION = "ome.io/v1beta1"


@dataclass(frozen=True, slots=True)
class InvalidObject:
    """A TrafficMap that failed validation: its key and raw form survive so it can be reported."""

    key: MapKey
    generation: int
    message: str
    raw: dict[str, Any]

    @property
    def deletion_timestamp(self) -> str | None:
        metadata = self.raw.get("metadata")
        value = metadata.get("deletionTimestamp") if isinstance(metadata, dict) else None
        return str(value) if value else None


def describe_validation_error(exc: ValidationError) -> str:
    """One line per problem, each naming the field path: `spec.entries[0].weight: ...`."""
    parts = []
    for error in exc.errors():
        path = ""
        for loc in error["loc"]:
            if isinstance(loc, int):
                path += f"[{loc}]"
            else:
                path += f".{loc}" if path else str(loc)
        value = error.get("input")
        shown = f" (got {value!r})" if not isinstance(value, (dict, list)) else ""
        parts.append(f"{path or '<root>'}: {error['msg']}{shown}")
    return "; ".join(parts)


def object_key(raw: dict[str, Any]) -> MapKey | None:
    """The namespace/name of a raw object, or None when it has no usable name."""
    metadata = raw.get("metadata")
    if not isinstance(metadata, dict):
        return None
    name, namespace = metadata.get("name"), metadata.get("namespace", "default")
    if not isinstance(name, str) or not name or not isinstance(namespace, str):
        return None
    return MapKey(namespace, name)


def parse_status_change(held: TrafficMap | InvalidObject, raw: dict[str, Any]) -> TrafficMap | InvalidObject:
    """`raw` as `parse_traffic_map` makes it, when all of it but its status, resourceVersion and
    managedFields is what `held` was parsed from (its digest says so): only the status is
    validated, and the metadata and spec are `held`'s, as is each condition equal to one `held`
    has. The echo of our own condition so makes a status and our condition, not a map: at 10,000
    maps the start's 10,000 echoes made some 220,000 objects that the collector then walked in one
    go, and every object an echo keeps is one more for each full collection to walk."""
    if not isinstance(held, TrafficMap):
        return parse_traffic_map(raw)
    try:
        status = validate(TrafficMapStatus, raw.get("status", {}))
        version = validate(StrictStr, raw["metadata"].get("resourceVersion", ""))
    except ValidationError:
        return parse_traffic_map(raw)
    held_conditions = {condition.type: condition for condition in held.status.conditions}
    conditions = status.conditions  # made just now, seen by no one yet
    for index, condition in enumerate(conditions):
        same = held_conditions.get(condition.type)
        if same == condition:
            conditions[index] = same
    return TrafficMap(metadata=dataclasses.replace(held.metadata, resource_version=version), spec=held.spec, status=status)


def parse_traffic_map(raw: dict[str, Any]) -> TrafficMap | InvalidObject:
    """A TrafficMap, or the reason it is not one. Raises ValueError only when it has no name at all."""
    key = object_key(raw)
    if key is None:
        raise ValueError("TrafficMap without metadata.name")
    try:
        return validate(TrafficMap, raw)
    except ValidationError as exc:
        generation = raw["metadata"].get("generation", 0)
        return InvalidObject(
            key=key,
            generation=generation if isinstance(generation, int) else 0,
            message=describe_validation_error(exc),
            raw=raw,
        )
