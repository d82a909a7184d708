"""Builders of raw Kubernetes objects (plain dicts, as the API or a YAML file gives them).

Each returns a valid object; a test passes only what differs. The defaults are the seed's `chat`
example: namespace prod, InferenceService generation 6, worker-a 4 replicas (weight 2) and
worker-b 2 replicas with factor "3" (weight 3), every gate passing.

    make_map(entries=[make_entry("a", ready=0, weight=0, healthy=False)], generation=4)
    make_map(spec={"mode": "Single"})          # `**overrides` are merged deeply into the object
    make_map(status={"sourceUID": None})       # ... and None removes a key
"""

from __future__ import annotations

import copy
from typing import Any

from publisher.core.model import Entry, InferenceService, TrafficMap, parse_traffic_map, validate

CHAT_UID = "5d3c6f2e-8a41-4b7e-9c2d-1f0e6a7b8c90"
CHAT_HOST = "chat.example.com"
API_VERSION = "ome.io/v1beta1"


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of `base` with `overrides` merged in: dicts merge, None deletes, others replace."""
    result = copy.deepcopy(base)
    for key, value in overrides.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merge(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def make_condition(
    type_: str,
    status: str = "True",
    *,
    reason: str | None = None,
    observed_generation: int | None = 3,
    message: str = "",
    **overrides: Any,
) -> dict[str, Any]:
    """A metav1.Condition; `reason` defaults to the type (True) or "Unknown"."""
    condition: dict[str, Any] = {
        "type": type_,
        "status": status,
        "reason": reason if reason is not None else (type_ if status == "True" else "Unknown"),
        "message": message,
        "lastTransitionTime": "2025-01-01T00:00:00Z",
    }
    if observed_generation is not None:
        condition["observedGeneration"] = observed_generation
    return merge(condition, overrides)


def make_entry(
    cluster: str = "worker-a",
    *,
    allocated: int | None = 1,
    ready: int | None = 1,
    factor: str | None = None,
    weight: int = 1,
    healthy: bool = True,
    endpoint: str | None = None,
    gated: bool | None = None,
    drain_refs: list[str] | None = None,
    service: str = "chat",
    namespace: str = "prod",
    **overrides: Any,
) -> dict[str, Any]:
    """One spec.entries[] item. allocated/ready of 0 or None are omitted, as OME omits them.

    `gated` adds a probe block; `endpoint` defaults to http://<service>.<namespace>.<cluster>.example.com.
    """
    capacity: dict[str, Any] = {"source": "ControlPlane"}
    if allocated:
        capacity["allocated"] = allocated
    if ready:
        capacity["ready"] = ready
    if factor is not None:
        capacity["factor"] = factor
    entry: dict[str, Any] = {
        "cluster": cluster,
        "endpoint": endpoint if endpoint is not None else f"http://{service}.{namespace}.{cluster}.example.com",
        "weight": weight,
        "healthy": healthy,
        "capacity": capacity,
    }
    if gated is not None:
        entry["probe"] = {"result": "Failing" if gated else "Passing", "gated": gated}
    if drain_refs:
        entry["drainRefs"] = list(drain_refs)
    return merge(entry, overrides)


def chat_entries(namespace: str = "prod", service: str = "chat") -> list[dict[str, Any]]:
    """The seed's table: worker-a 4 replicas (weight 2), worker-b 2 replicas with factor "3" (weight 3)."""
    return [
        make_entry("worker-a", allocated=4, ready=4, weight=2, namespace=namespace, service=service),
        make_entry("worker-b", allocated=2, ready=2, factor="3", weight=3, namespace=namespace, service=service),
    ]


def make_map(
    name: str = "chat",
    namespace: str = "prod",
    *,
    generation: int = 3,
    entries: list[dict[str, Any]] | None = None,
    isvc_uid: str = CHAT_UID,
    observed_isvc_generation: int = 6,
    mode: str = "All",
    routable: dict[str, Any] | None | bool = True,
    published: dict[str, Any] | None = None,
    observed_traffic_map_generation: int | None = None,
    resource_version: str = "1",
    **overrides: Any,
) -> dict[str, Any]:
    """A TrafficMap that passes every gate.

    `routable`: True for a current `Routable` condition, False or None for none, or a condition
    dict (see make_condition). `published`: OME's `Published` condition, absent by default.
    `isvc_uid` goes into status.sourceUID and the controller ownerReference.
    """
    conditions = []
    if routable is True:
        conditions.append(make_condition("Routable", observed_generation=generation))
    elif isinstance(routable, dict):
        conditions.append(routable)
    if published is not None:
        conditions.append(published)
    status: dict[str, Any] = {"sourceUID": isvc_uid, "conditions": conditions}
    if observed_traffic_map_generation is not None:
        status["observedTrafficMapGeneration"] = observed_traffic_map_generation
    tm = {
        "apiVersion": API_VERSION,
        "kind": "TrafficMap",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"tm-{namespace}-{name}",
            "generation": generation,
            "resourceVersion": resource_version,
            "ownerReferences": [
                {
                    "apiVersion": API_VERSION,
                    "kind": "InferenceService",
                    "name": name,
                    "uid": isvc_uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "service": name,
            "mode": mode,
            "observedISVCGeneration": observed_isvc_generation,
            "entries": entries if entries is not None else chat_entries(namespace, name),
        },
        "status": status,
    }
    return merge(tm, overrides)


def make_isvc(
    name: str = "chat",
    namespace: str = "prod",
    *,
    uid: str = CHAT_UID,
    generation: int = 6,
    host: str | None = "",
    capacity_factors: dict[str, str] | None = None,
    enabled: bool | None = None,
    deletion_timestamp: str | None = None,
    resource_version: str = "1",
    **overrides: Any,
) -> dict[str, Any]:
    """The InferenceService fields the publisher reads; `host` is the ome.io/global-host annotation
    (by default chat's CHAT_HOST, else `<name>.example.com`: two maps never share one by accident)."""
    if host == "":
        host = CHAT_HOST if name == "chat" else f"{name}.example.com"
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "uid": uid,
        "generation": generation,
        "resourceVersion": resource_version,
    }
    if host is not None:
        metadata["annotations"] = {"ome.io/global-host": host}
    if deletion_timestamp is not None:
        metadata["deletionTimestamp"] = deletion_timestamp
    routing: dict[str, Any] = {
        "capacityFactors": capacity_factors if capacity_factors is not None else {"worker-b": "3"}
    }
    if enabled is not None:
        routing["enabled"] = enabled
    isvc = {
        "apiVersion": API_VERSION,
        "kind": "InferenceService",
        "metadata": metadata,
        "spec": {"routing": routing},
    }
    return merge(isvc, overrides)


def valid_map(**kwargs: Any) -> TrafficMap:
    """make_map(**kwargs) parsed; fails the test when it is not a valid map."""
    item = parse_traffic_map(make_map(**kwargs))
    assert isinstance(item, TrafficMap), item
    return item


def valid_entry(cluster: str = "worker-a", **kwargs: Any) -> Entry:
    """make_entry(...) as a model.Entry."""
    return validate(Entry, make_entry(cluster, **kwargs))


def valid_isvc(**kwargs: Any) -> InferenceService:
    return validate(InferenceService, make_isvc(**kwargs))

