"""Types every stage shares: the TrafficMap and InferenceService as we read them, and our own values.

Owns the shape of the input (pydantic dataclasses, strict: a wrong type is refused with the field
path) and the
small frozen values that travel between stages (MapKey, Backend, Publication, Reason, Held).
Imports nothing of ours but `quantity`; no I/O.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal, NamedTuple, TypeVar

from pydantic import (
    AfterValidator,
    BeforeValidator,
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

from publisher.core.quantity import QuantityError, parse_quantity

MAX_WEIGHT = 1_000_000
T = TypeVar("T")

# DNS-1123 subdomain: what Kubernetes accepts as an object name, and so as a WorkloadCluster name.
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# A hostname a gateway routes on: a lower-case DNS name, optionally a leading wildcard label.
_HOSTNAME = re.compile(r"^(\*\.)?[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?(\.[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)*$")
# An endpoint is http(s), a plain host (DNS name, IPv4 or bracketed IPv6), an optional port and an
# optional path of unreserved characters: nothing a gateway's config syntax could read as syntax.
_ENDPOINT = re.compile(
    r"^(?P<scheme>https?)://"
    r"(?P<host>[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?)*"
    r"|\[[0-9A-Fa-f:.]+\])"
    r"(:(?P<port>[0-9]{1,5}))?"
    r"(?P<path>/[A-Za-z0-9._~/-]*)?$"
)


# One duration grammar for every option, the chart's values schema included (its `duration`
# definition is this pattern, tests/test_durations.py holds them together): Go's and Kubernetes'
# spelling, `1h30m`, `2m`, `60s`, `1.5s`, `500ms`, `0`, restricted to h, m, s and ms, each unit at
# most once and largest first, a unit on every number, digits on both sides of a decimal point.
DURATION_PATTERN = (
    r"^(0|([0-9]+(\.[0-9]+)?h)?([0-9]+(\.[0-9]+)?m)?([0-9]+(\.[0-9]+)?s)?([0-9]+(\.[0-9]+)?ms)?)$"
)
DURATION_EXAMPLES = "1h30m, 2m, 60s, 1.5s, 500ms"
_DURATION = re.compile(DURATION_PATTERN)
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|h|m|s)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: Any, *, zero_ok: bool = False) -> float:
    """A duration string of DURATION_PATTERN ('1h30m', '500ms') or a number of seconds (from
    code or a YAML number); zero only with `zero_ok`."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        text = str(value).strip()
        if text.startswith("-") and _DURATION.match(text[1:]):
            raise ValueError(f"{value!r} is negative: it must be {'0 or longer' if zero_ok else 'longer than zero'}")
        if not text or _DURATION.match(text) is None:
            raise ValueError(f"{value!r} is not a duration such as {DURATION_EXAMPLES} (a unit on every number)")
        seconds = sum(float(number) * _UNITS[unit] for number, unit in _DURATION_PART.findall(text))
    if seconds < 0 or (seconds == 0 and not zero_ok):
        raise ValueError(f"{value!r} must be {'0 or longer' if zero_ok else 'longer than zero'}")
    return seconds


def format_duration(seconds: float) -> str:
    """`seconds` in the duration grammar, largest unit first: 90 -> 1m30s, 0.5 -> 500ms, 0 -> 0s."""
    if seconds == 0:
        return "0s"
    if seconds < 1:
        return f"{seconds * 1000:g}ms"
    hours, rest = divmod(seconds, 3600.0)
    minutes, rest = divmod(rest, 60.0)
    parts = [f"{value:g}{unit}" for value, unit in ((hours, "h"), (minutes, "m"), (rest, "s")) if value]
    return "".join(parts)


@dataclass(frozen=True, slots=True)
class DurationRange:
    """The durations one option takes: longer than zero (or zero too, `zero_ok`), at least
    `least` and at most `most` seconds. Every duration option has a ceiling, so that a slip like
    `100000000h` is refused instead of meaning "never". It is the option's validator, and the
    chart's check of the value feeding the option is generated from it (tools/chart_limits.py)."""

    most: float
    least: float = 0.0
    zero_ok: bool = False
    why: str = ""  # why the floor is where it is, for the refusal

    def describe(self) -> str:
        """The range in words, for the help: `10s to 1h`, `0 to 1h`, `at most 24h`."""
        if self.least:
            return f"{format_duration(self.least)} to {format_duration(self.most)}"
        return f"0 to {format_duration(self.most)}" if self.zero_ok else f"at most {format_duration(self.most)}"

    def __call__(self, value: Any) -> float:
        seconds = parse_duration(value, zero_ok=self.zero_ok)
        if seconds < self.least:
            raise ValueError(f"{value!r} is shorter than {format_duration(self.least)}" + (f": {self.why}" if self.why else ""))
        if seconds > self.most:
            raise ValueError(f"{value!r} is longer than {format_duration(self.most)}, the longest this option takes")
        return seconds


HOUR = 3600.0
DAY = 24 * HOUR
# Options in seconds that take the duration grammar, in the default ranges: longer than zero
# (Duration) or zero too (Interval, "no wait"), at most a day. An option with another range
# annotates itself the same way with its own DurationRange.
Duration = Annotated[float, BeforeValidator(DurationRange(DAY))]
Interval = Annotated[float, BeforeValidator(DurationRange(DAY, zero_ok=True))]
# How a help text names the forms parse_duration takes.
DURATION_UNITS = f"a duration: {DURATION_EXAMPLES}"


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


@dataclass(frozen=True, slots=True)
class Endpoint:
    scheme: str
    host: str
    port: int
    path: str

    @property
    def tls(self) -> bool:
        return self.scheme == "https"


def split_host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{value!r} is not HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


# Each endpoint is checked when its map is read, again when a gateway checks and renders it, and
# again on every change of the map's weights: the IP parse alone made this a fifth of the CPU
# of a first publish at 10,000 maps. Pure, so one parse per distinct URL is enough.
@functools.lru_cache(maxsize=1 << 16)
def parse_endpoint(url: str) -> Endpoint:
    """Splits a validated endpoint URL; the port defaults to the scheme's. Raises ValueError.

    The host is an IP literal that `ipaddress` reads (IPv6 in brackets) or a DNS name of at most
    253 characters, labels of at most 63, whose last label is not all digits: `4294967295` or
    `010.0.0.1` would reach a resolver that may read them as other addresses."""
    match = _ENDPOINT.fullmatch(url)
    if match is None:
        raise ValueError(f"{url!r} is not an http(s) URL with a plain host")
    host_problem = _endpoint_host_problem(match["host"])
    if host_problem is not None:
        raise ValueError(f"{url!r}: {host_problem}")
    scheme = match["scheme"]
    port = int(match["port"]) if match["port"] else (443 if scheme == "https" else 80)
    if not 0 < port < 65536:
        raise ValueError(f"{url!r} has port {port}, outside 1..65535")
    return Endpoint(scheme=scheme, host=match["host"], port=port, path=match["path"] or "")


def _endpoint_host_problem(host: str) -> str | None:
    if host.startswith("["):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"{host} is not an IPv6 address"
        return None
    if _all_digit_label(host.rsplit(".", 1)[-1]):
        if is_canonical_ipv4(host):
            return None
        try:
            address = ipaddress.IPv4Address(host)
        except ValueError:
            return f"{host} looks numeric but is not a dotted-quad IPv4 address"
        if str(address) != host:
            return f"{host} is not in canonical dotted-quad form"
        return None
    return _dns_name_problem(host.lower())


_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_CANONICAL_IPV4 = re.compile(rf"{_OCTET}(?:\.{_OCTET}){{3}}")


def is_canonical_ipv4(host: str) -> bool:
    """A dotted quad as `ipaddress` writes it (no leading zeros): the common case, checked
    without ipaddress, whose parse was a third of rendering 10,000 maps."""
    return _CANONICAL_IPV4.fullmatch(host) is not None


def _all_digit_label(label: str) -> bool:
    return label.isdigit() or (label.lower().startswith("0x") and all(c in "0123456789abcdef" for c in label[2:].lower()))


def _dns_name_problem(name: str) -> str | None:
    if len(name) > 253:
        return f"a DNS name has at most 253 characters ({len(name)})"
    for label in name.split("."):
        if len(label) > 63:
            return f"DNS label {label[:20]}... has {len(label)} characters, at most 63"
    return None


def is_dns_label(value: str) -> bool:
    return bool(_DNS_LABEL.fullmatch(value))


def is_dns_subdomain(value: str) -> bool:
    return len(value) <= 253 and bool(_DNS1123_SUBDOMAIN.fullmatch(value))


def is_hostname(value: str) -> bool:
    """A lower-case DNS name a gateway can route on (optionally `*.`); never all-numeric, so it
    cannot be read as an address."""
    if len(value) > 253 or not _HOSTNAME.fullmatch(value):
        return False
    return not _all_digit_label(value.rsplit(".", 1)[-1])


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


# Each region's condition on a TrafficMap has the type CONDITION_PREFIX + region (the status
# writer sets its own; the source and the fleet view read the other regions').
CONDITION_PREFIX = "gateway-publisher.ome.io/"


def condition_type(instance: str) -> str:
    return CONDITION_PREFIX + instance


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
