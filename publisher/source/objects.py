"""What the source reads of one raw object: its resourceVersion, the digest of what the loop reads
of a TrafficMap, and an InferenceService parsed (or refused with a warning)."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import pydantic_core
from pydantic import ValidationError

from publisher.core.model import InferenceService, describe_validation_error, object_key, validate
from publisher.core.values import CONDITION_PREFIX

log = logging.getLogger("publisher.source")  # the logger name these logs have always printed


def resource_version(raw: dict[str, Any]) -> str:
    """A raw object's metadata.resourceVersion ("" when it has none)."""
    return str(raw.get("metadata", {}).get("resourceVersion", ""))


def relevant_digest(raw: dict[str, Any], own_condition: str) -> bytes | None:
    """A digest of what the loop reads of a TrafficMap: all of it but metadata.managedFields and
    .resourceVersion and the conditions of our family that are not `own_condition`. Two events
    with one digest differ only in other instances' verdicts. Our own condition counts: the
    ConditionSink compares with it once the Store's version passes its write.

    None when no other instance has a condition on the map: then an event that changes nothing
    but other instances' verdicts cannot happen, and one region alone pays nothing for the digest
    (22 us an event). The event that brings the first one is parsed in full, once."""
    status = raw.get("status")
    conditions = status.get("conditions") if isinstance(status, dict) else None
    if not isinstance(conditions, list) or not any(_foreign(c, own_condition) for c in conditions):
        return None
    view = dict(raw)
    metadata = raw.get("metadata")
    if isinstance(metadata, dict):
        view["metadata"] = {k: v for k, v in metadata.items() if k not in ("managedFields", "resourceVersion")}
    view["status"] = {**status, "conditions": [c for c in conditions if not _foreign(c, own_condition)]}
    return hashlib.blake2b(pydantic_core.to_json(view), digest_size=16).digest()


def _foreign(condition: Any, own_condition: str) -> bool:
    kind = condition.get("type") if isinstance(condition, dict) else None
    return isinstance(kind, str) and kind.startswith(CONDITION_PREFIX) and kind != own_condition


def parse_isvc(raw: dict[str, Any]) -> InferenceService | None:
    try:
        return validate(InferenceService, raw)
    except ValidationError as exc:
        log.warning("inferenceservice unreadable", extra={"object": str(object_key(raw)), "error": describe_validation_error(exc)})
        return None
