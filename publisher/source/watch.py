"""The watch protocol, free of I/O: each line of a watch stream turned into what it means, and the
resourceVersion to resume from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from publisher.kube import decode_json
from publisher.source.objects import resource_version


@dataclass(frozen=True, slots=True)
class Event:
    type: str  # ADDED | MODIFIED | DELETED
    object: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Bookmark:
    resource_version: str


@dataclass(frozen=True, slots=True)
class Relist:
    """The watch cannot go on from its version (410 Gone): list again."""

    reason: str


class WatchError(Exception):
    """A watch ERROR event other than 410: reconnect from the last version."""


class WatchState:
    """Tracks the resourceVersion of a watch and turns each line into what it means."""

    def __init__(self, resource_version: str) -> None:
        self.resource_version = resource_version

    def feed(self, line: bytes) -> Event | Bookmark | Relist | None:
        line = line.strip()
        if not line:
            return None
        try:
            event = decode_json(line)
            kind, obj = event["type"], event["object"]
        except (ValueError, KeyError, TypeError) as exc:
            raise WatchError(f"undecodable watch line: {line[:200]!r}") from exc
        if kind == "ERROR":
            code = obj.get("code") if isinstance(obj, dict) else None
            if code == 410:
                return Relist(str(obj.get("reason") or "Expired"))
            raise WatchError(f"watch error {code}: {obj.get('message') if isinstance(obj, dict) else obj}")
        if not isinstance(obj, dict):
            raise WatchError(f"watch event without an object: {line[:200]!r}")
        version = resource_version(obj)
        if version:
            self.resource_version = version
        if kind == "BOOKMARK":
            return Bookmark(version)
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            return Event(kind, obj)
        raise WatchError(f"unknown watch event type {kind!r}")
