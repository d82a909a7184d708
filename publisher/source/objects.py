"""What the source reads of one raw object: its resourceVersion, the digest of what the loop reads
of a TrafficMap (`map_digest`), and an InferenceService parsed (or refused with a warning)."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import pydantic_core
from pydantic import ValidationError

from publisher.core.model import InferenceService, describe_validation_error, object_key, validate
from publisher.core.values import CONDITION_PREFIX

log = logging.getLogger("publisher.source")  # the logger name these logs have always printed


def resource_version(raw: dict[str, Any]) -> str:
    """A raw object's metadata.resourceVersion ("" when it has none)."""
    return str(raw.get("metadata", {}).get("resourceVersion", ""))


@dataclass(frozen=True, slots=True)
class MapDigest:
    """What one event of a TrafficMap carries that the loop reads: `decided`, a digest of all the
    map but metadata.managedFields and .resourceVersion and every instance's condition (what a
    decision is made from), and `own`, this instance's condition as the server holds it (None: it
    has none), which only the status writer reads."""

    decided: bytes
    own: Any


def map_digest(raw: dict[str, Any], own_condition: str) -> MapDigest:
    """The MapDigest of a raw TrafficMap. Two events with one `decided` differ only in verdicts:
    other instances' (nothing of ours reads them) or ours (the echo of the status writer's own
    write, which nothing needs to decide again). About 22 us an event, against the 50 us of a
    parse and the 200 us of a pass that decides nothing new."""
    status = raw.get("status")
    conditions = status.get("conditions") if isinstance(status, dict) else None
    view = dict(raw)
    metadata = raw.get("metadata")
    if isinstance(metadata, dict):
        view["metadata"] = {k: v for k, v in metadata.items() if k not in ("managedFields", "resourceVersion")}
    own = None
    if isinstance(conditions, list):
        assert isinstance(status, dict)
        own = next((c for c in conditions if _type(c) == own_condition), None)
        view["status"] = {**status, "conditions": [c for c in conditions if not _type(c).startswith(CONDITION_PREFIX)]}
    return MapDigest(hashlib.blake2b(pydantic_core.to_json(view), digest_size=16).digest(), own)


def _type(condition: Any) -> str:
    kind = condition.get("type") if isinstance(condition, dict) else None
    return kind if isinstance(kind, str) else ""


def parse_isvc(raw: dict[str, Any]) -> InferenceService | None:
    try:
        return validate(InferenceService, raw)
    except ValidationError as exc:
        log.warning("inferenceservice unreadable", extra={"object": str(object_key(raw)), "error": describe_validation_error(exc)})
        return None
