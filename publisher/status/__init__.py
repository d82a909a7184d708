"""Where the sidecar's verdicts go (SPEC §5): a StatusSink, and the condition on each TrafficMap.

`StatusSink` is the seam: the Publisher's status writer hands it the verdicts that may have
changed. `ConditionSink` writes this instance's one condition on each TrafficMap.
`condition_for` is pure: from what happened to a map and the condition it already carries, the
condition to apply, or None when it would change nothing (so a restart writes nothing new).
`write_condition` sends only that condition by server-side apply on the status subresource, with
the instance's own field manager, so OME's conditions and fields are never touched.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import ValidationError

from publisher import metrics
from publisher.kube import TRAFFIC_MAPS, Kube, KubeError
from publisher.core.model import API_VERSION, TRAFFIC_MAP_KIND, Condition, InvalidObject, TrafficMap, validate
from publisher.core.values import MapKey, Reason, condition_type

if TYPE_CHECKING:
    from publisher.source.store import Store

log = logging.getLogger(__name__)

FIELD_MANAGER_PREFIX = "ome-gateway-publisher-"
# metav1.Condition's validation: reason pattern and message length.
_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
_MAX_MESSAGE = 32768
# Comparing a verdict with the map's condition takes about 20 us: a batch gives the event loop
# back after each slice of this many, so a resync's 10,000 (nearly all unchanged) never hold it
# for more than a few ms; one task per verdict held it 200 ms.
STATUS_SLICE = 256


def field_manager(region: str) -> str:
    return FIELD_MANAGER_PREFIX + region


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the gateway holds for a map, as its condition will say it."""

    published: bool
    reason: Reason
    message: str
    generation: int
    uid: str = ""  # the map's metadata.uid: a map deleted and made again is another map


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition_for(verdict: Verdict, region: str, existing: Condition | None, now: datetime) -> dict[str, Any] | None:
    """The condition to apply, or None when `existing` already says the same.
    lastTransitionTime moves only when status changes."""
    status = "True" if verdict.published else "False"
    reason = str(verdict.reason)
    if not _REASON.match(reason):
        raise ValueError(f"reason {reason!r} is not a valid condition reason")
    message = verdict.message[:_MAX_MESSAGE]
    if (
        existing is not None
        and existing.status == status
        and existing.reason == reason
        and existing.message == message
        and existing.observed_generation == verdict.generation
    ):
        return None
    transition = existing.last_transition_time if existing is not None and existing.status == status and existing.last_transition_time else rfc3339(now)
    return {
        "type": condition_type(region),
        "status": status,
        "reason": reason,
        "message": message,
        "observedGeneration": verdict.generation,
        "lastTransitionTime": transition,
    }


async def write_condition(kube: Kube, key: MapKey, condition: dict[str, Any], region: str) -> str:
    """Server-side apply of this one condition to trafficmaps/status; the resourceVersion the
    server gave the map. Raises KubeError."""
    body = {
        "apiVersion": API_VERSION,
        "kind": TRAFFIC_MAP_KIND,
        "metadata": {"name": key.name, "namespace": key.namespace},
        "status": {"conditions": [condition]},
    }
    applied = await kube.apply(TRAFFIC_MAPS, body, field_manager=field_manager(region), subresource="status")
    return str((applied.get("metadata") or {}).get("resourceVersion", ""))


async def remove_condition(kube: Kube, key: MapKey, region: str) -> bool:
    """Take `instance`'s condition off a map: an apply of no conditions under its field manager
    removes only what it owned. False when the map is gone. Raises KubeError."""
    body = {
        "apiVersion": API_VERSION,
        "kind": TRAFFIC_MAP_KIND,
        "metadata": {"name": key.name, "namespace": key.namespace},
        "status": {"conditions": []},
    }
    try:
        await kube.apply(TRAFFIC_MAPS, body, field_manager=field_manager(region), subresource="status")
    except KubeError as exc:
        if exc.not_found:
            return False
        raise
    return True


class SinkUnavailable(Exception):
    """No verdict can be written: what the sink needs is missing (a CRD, a permission, the API
    server). The message says what, in one line; the caller retries the whole batch with backoff."""


class StatusSink(Protocol):
    """Where this instance's verdicts go. Driven only by the Publisher's status-writer task."""

    def stale(self) -> None:
        """What the server holds may have changed behind this writer (it just won the Lease, or a
        resync is due): read it again before the next write, and repair what differs."""
        ...

    async def write(self, verdicts: Mapping[MapKey, Verdict | None]) -> Mapping[MapKey, str]:
        """Write each verdict that changed (None: the map is gone; forget it). Returns the keys that
        failed, each with a one-line reason; the caller retries them with backoff. Raises
        SinkUnavailable when nothing can be written."""
        ...


def caught_up(seen: str, written: str) -> bool:
    """Whether a map seen at resourceVersion `seen` includes our write that returned `written`.
    Versions are compared as numbers, as every API server backed by etcd gives them; an opaque
    pair counts only when equal."""
    if seen.isdigit() and written.isdigit():
        return int(seen) >= int(written)
    return seen == written


class ConditionSink:
    """This instance's condition on each TrafficMap, compared with what the map already says.

    The watch cache (`maps`) lags our own writes: compared with it alone, a verdict is written
    again on every re-decide until our write's event arrives, with a new lastTransitionTime, which
    is a real change and an event for every other region, whose caches lag too (issue 20). So the
    sink remembers the condition it last wrote per map and the resourceVersion the apply returned,
    and compares with that until the cache holds that version or a newer one.

    `drop_leftovers` removes what this region left in report mode (its RegionReports): run before
    the first write and again after each `stale`, so `status` never weighs an old report against
    the condition. Raises KubeError; a failure is logged once and tried again at the next `stale`."""

    def __init__(
        self,
        kube: Kube,
        maps: Store[TrafficMap | InvalidObject],
        region: str,
        *,
        wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        concurrency: int = 8,
        drop_leftovers: Callable[[], Awaitable[int]] | None = None,
    ) -> None:
        self._kube = kube
        self._drop_leftovers = drop_leftovers
        self._leftovers_due = drop_leftovers is not None
        self._leftovers_problem: str | None = None
        self._maps = maps
        self._region = region
        self._type = condition_type(region)
        self._wall_clock = wall_clock
        # A few concurrent writes keep 10,000 first-time conditions to seconds without flooding
        # the API server.
        self._concurrency = concurrency
        # Each condition as applied: a dict of strings and numbers, which the collector does not
        # track (as a model, a start's 10,000 writes left 10,000 more objects for its full pass).
        self._written: dict[MapKey, tuple[dict[str, Any], str]] = {}
        # Looked up once: a start writes one condition per map, and a lookup cost a tenth of a write.
        self._written_count = metrics.STATUS_WRITES.labels(result="written")

    def stale(self) -> None:
        # The watch cache is live: only what report mode may have left needs another look.
        self._leftovers_due = self._drop_leftovers is not None

    async def _leftovers(self) -> None:
        assert self._drop_leftovers is not None
        self._leftovers_due = False
        try:
            dropped = await self._drop_leftovers()
        except KubeError as exc:
            problem = str(exc)
            if problem != self._leftovers_problem:
                log.warning("cannot remove this region's RegionReports left from report mode", extra={"error": problem})
            self._leftovers_problem = problem
            return
        self._leftovers_problem = None
        if dropped:
            log.info("removed this region's RegionReports left from report mode", extra={"reports": dropped})

    async def write(self, verdicts: Mapping[MapKey, Verdict | None]) -> Mapping[MapKey, str]:
        if self._leftovers_due:
            await self._leftovers()
        failed: dict[MapKey, str] = {}
        writes: deque[tuple[MapKey, dict[str, Any]]] = deque()
        for count, (key, verdict) in enumerate(verdicts.items(), 1):
            if count % STATUS_SLICE == 0:
                await asyncio.sleep(0)
            if verdict is None:
                self._written.pop(key, None)
            elif verdict.uid and _uid(self._maps.get(key)) not in ("", verdict.uid):
                continue  # about a map deleted before the one of this name was made: its verdict follows
            elif (condition := condition_for(verdict, self._region, self._current(key), self._wall_clock())) is not None:
                writes.append((key, condition))

        async def writer() -> None:
            # A few writers take the conditions in turn: as many tasks as concurrent writes,
            # however large the batch.
            while writes:
                key, condition = writes.popleft()
                try:
                    version = await write_condition(self._kube, key, condition, self._region)
                except KubeError as exc:
                    if exc.not_found:  # the map is gone; its deletion event follows
                        self._written.pop(key, None)
                    else:
                        failed[key] = str(exc)
                    continue
                self._written[key] = (condition, version)
                self._written_count.inc()

        async with asyncio.TaskGroup() as group:
            for _ in range(min(self._concurrency, len(writes))):
                group.create_task(writer())
        return failed

    def _current(self, key: MapKey) -> Condition | None:
        """Our condition on the map as far as we know: what we last wrote until the cache shows
        that write, then what the cache holds."""
        written = self._written.get(key)
        if written is not None:
            condition, version = written
            if not caught_up(self._maps.version(key), version):
                return validate(Condition, condition)
            del self._written[key]
        return self._seen(self._maps.get(key))

    def _seen(self, item: TrafficMap | InvalidObject | None) -> Condition | None:
        return own_condition(item, self._region)


def _uid(item: TrafficMap | InvalidObject | None) -> str:
    """The map's metadata.uid as the watch cache holds it ("": none known)."""
    if isinstance(item, TrafficMap):
        return item.metadata.uid
    metadata = item.raw.get("metadata") if item is not None else None
    uid = metadata.get("uid") if isinstance(metadata, dict) else None
    return uid if isinstance(uid, str) else ""


def own_condition(item: TrafficMap | InvalidObject | None, region: str) -> Condition | None:
    """The condition `instance` wrote on a map, as the watch cache holds the map."""
    kind = condition_type(region)
    if isinstance(item, TrafficMap):
        return item.status.condition(kind)
    if isinstance(item, InvalidObject):
        # An invalid map still carries our condition: read it, or it would be written on every pass.
        status = item.raw.get("status")
        conditions = status.get("conditions") if isinstance(status, dict) else None
        for raw in conditions if isinstance(conditions, list) else ():
            if isinstance(raw, dict) and raw.get("type") == kind:
                try:
                    return validate(Condition, raw)
                except ValidationError:
                    return None
    return None
