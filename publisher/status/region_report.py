"""The report status mode: each region's verdicts live off the TrafficMap, in RegionReports.

A RegionReport (gateway-publisher.ome.io/v1alpha1, namespaced, shipped by the chart as a CRD) holds
one region's verdicts on at most SHARD_ENTRIES (8) maps of one namespace, in that namespace, named
`<region>-<index>` and labelled `gateway-publisher.ome.io/region: <region>`:

    region: eu-west
    maps:                       # map name -> the facts of the condition mode's condition
      chat: {observedGeneration: 3, status: "True", reason: Published, message: ..., lastTransitionTime: ..., uid: ...}

No sidecar watches RegionReports, so a verdict is one write that reaches no sidecar's watch,
whatever the number of regions; a TrafficMap stays the size OME makes it. `maps` is atomic
(x-kubernetes-map-type), so managedFields name one field, not every map.

`RegionReportSink` is a region's one writer, driven by the Publisher's status-writer task while it
leads. It remembers each shard as last read or written (entries and resourceVersion) and writes a
shard only when a verdict in it changed, once per batch: a create (POST, 409 if another instance of
the region made it first), an apply under the region's field manager with the resourceVersion it
last saw as a precondition, or, when its last map is gone, a delete with the same precondition.
So a region writes only its own objects, and within a region a stale writer (a leader that lost
its Lease) gets 409 Conflict instead of overwriting; it re-reads that shard and the caller retries.
It reads the region's reports before its first write and again after `stale` (a Lease won, each
resync), so what was deleted or edited behind it is rewritten; when they cannot be read (no CRD,
no RBAC, no API server) it raises status.SinkUnavailable and the caller retries with backoff.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from publisher import metrics, status
from publisher.kube import Kube, KubeError, Resource
from publisher.core.model import Condition, validate
from publisher.core.values import MapKey

log = logging.getLogger("publisher.region_report")

GROUP = "gateway-publisher.ome.io"
REGION_REPORTS = Resource(GROUP, "v1alpha1", "regionreports", "RegionReport")
REGION_LABEL = f"{GROUP}/region"
# etcd stores a whole object per write, so a shard's size is what one verdict change costs: a
# typical verdict is 222 B of JSON, and a full shard of 8 about 2.4 KB with its metadata (32: 7.7
# KB, 128: 29 KB). At worst (253-character names, messages at MAX_MESSAGE) a shard is 12 KB, under
# 1% of etcd's 1.5 MiB request limit. A start-up of 10,000 maps is 1,250 writes per region, not 10,000.
SHARD_ENTRIES = 8
# A message longer than this is cut (the sidecar's log and /debug/maps keep it whole): with map
# names of at most 253 characters, it is what bounds a shard's size.
MAX_MESSAGE = 1024
_ENTRY_FIELDS = ("observedGeneration", "status", "reason", "message", "lastTransitionTime")
# The map's metadata.uid, beside the condition's facts: a verdict is about one map, not one name.
_UID = "uid"
CRD = f"{REGION_REPORTS.plural}.{GROUP}"
_INSTALL_CRD = "install it on the control plane: helm show crds <chart> | kubectl apply -f - (the chart's crds/)"
# Lists of this many objects a page: a region's reports at 10,000 maps are 1,250 objects, 13
# pages. The sink loads each page (800 verdicts) before it asks for the next, so the event loop is
# free every few milliseconds; 1,250 loaded at once held it 150 ms at each resync.
_PAGE = 100


def shard_name(region: str, index: int) -> str:
    return f"{region}-{index}"


def report_object(region: str, namespace: str, index: int, entries: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": REGION_REPORTS.api_version,
        "kind": REGION_REPORTS.kind,
        "metadata": {"name": shard_name(region, index), "namespace": namespace, "labels": {REGION_LABEL: region}},
        "region": region,
        "maps": {name: dict(entry) for name, entry in sorted(entries.items())},
    }


@dataclass(frozen=True, slots=True)
class RecordedVerdict:
    """One region's verdict on one map, as a condition or a RegionReport entry says it."""

    region: str
    mode: str  # condition | report
    status: str
    reason: str
    message: str
    observed_generation: int | None
    last_transition_time: str
    uid: str = ""  # the map's uid the verdict is about ("": not recorded, a condition or an old entry)

    def published(self, generation: int) -> bool:
        """This region serves the map's current generation."""
        return self.status == "True" and self.observed_generation == generation

    def about(self, uid: str) -> bool:
        """Whether the verdict is about the map of this uid (not one deleted before it was made)."""
        return not self.uid or not uid or self.uid == uid


def parse_entry(region: str, raw: Any, mode: str = "report") -> RecordedVerdict | None:
    """A RegionReport entry (or a condition) as a Verdict; None for one this module did not write."""
    if not isinstance(raw, dict):
        return None
    try:
        condition = validate(Condition, {"type": "x", **{k: raw[k] for k in _ENTRY_FIELDS if k in raw}})
    except ValidationError:
        return None
    uid = raw.get(_UID)
    return RecordedVerdict(region, mode, condition.status, condition.reason, condition.message,
                   condition.observed_generation, condition.last_transition_time, uid if isinstance(uid, str) else "")


def parse_report(raw: Mapping[str, Any]) -> tuple[str, int, dict[str, RecordedVerdict]] | None:
    """(region, shard index, verdict by map name) of a RegionReport; None when it is not one of ours."""
    metadata = raw.get("metadata") or {}
    region = (metadata.get("labels") or {}).get(REGION_LABEL)
    name = metadata.get("name")
    if not isinstance(region, str) or not isinstance(name, str) or raw.get("region") != region:
        return None
    prefix, _, index = name.rpartition("-")
    maps = raw.get("maps")
    if prefix != region or not index.isdigit() or not isinstance(maps, dict):
        return None
    verdicts = {}
    for map_name, entry in maps.items():
        verdict = parse_entry(region, entry)
        if verdict is not None:
            verdicts[str(map_name)] = verdict
    return region, int(index), verdicts


async def report_pages(kube: Kube, namespaces: tuple[str, ...] = (), label_selector: str | None = None) -> AsyncIterator[list[dict[str, Any]]]:
    """The RegionReports in `namespaces` (all when empty), a page at a time. Raises KubeError."""
    for namespace in namespaces or (None,):
        token: str | None = None
        while True:
            page = await kube.list(REGION_REPORTS, namespace=namespace, label_selector=label_selector, limit=_PAGE, continue_token=token)
            yield page.get("items") or []
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                break


async def list_reports(kube: Kube, namespaces: tuple[str, ...] = (), label_selector: str | None = None) -> list[dict[str, Any]]:
    """Every RegionReport in `namespaces` (all when empty). Raises KubeError."""
    return [item async for page in report_pages(kube, namespaces, label_selector) for item in page]


def unavailable(exc: KubeError) -> str:
    """One line: why this region's RegionReports cannot be read, and what to do about it."""
    if exc.not_found:
        return f"the CRD {CRD} is not installed ({exc}); {_INSTALL_CRD}"
    if exc.code == 403:
        return (f"not allowed to read {CRD} ({exc}); the region's RBAC needs get, list, create, patch and "
                "delete on regionreports (the chart grants them with statusMode: report)")
    return f"cannot read this region's RegionReports ({exc})"


async def forget_region(kube: Kube, region: str, namespaces: tuple[str, ...] = ()) -> int:
    """Delete every RegionReport of `region` in `namespaces` (all when empty): what is left of a
    region that was removed. Returns how many were deleted. Raises KubeError."""
    deleted = 0
    for raw in await list_reports(kube, namespaces, f"{REGION_LABEL}={region}"):
        metadata = raw["metadata"]
        try:
            await kube.delete(REGION_REPORTS, metadata["namespace"], metadata["name"])
        except KubeError as exc:
            if not exc.not_found:
                raise
            continue
        deleted += 1
    return deleted


async def drop_leftovers(kube: Kube, region: str, namespaces: tuple[str, ...] = ()) -> int:
    """A region in condition mode deletes the RegionReports it left in report mode; no CRD means
    none. Returns how many were deleted. Raises KubeError."""
    try:
        return await forget_region(kube, region, namespaces)
    except KubeError as exc:
        if exc.not_found:
            return 0
        raise


@dataclass
class _Shard:
    """One RegionReport as the server last had it: entries by map name, and its resourceVersion
    (None: not on the server)."""

    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    resource_version: str | None = None


ShardId = tuple[str, int]  # (namespace, index)


class RegionReportSink:
    """One region's RegionReports: the report mode's status sink (see the module docstring).

    `known` says whether the source still holds a map; the first write after each read (which comes
    after the source's first full view) drops the entries of maps that went away meanwhile.
    `has_condition` says whether a map still carries this region's condition, left from condition
    mode: the sink takes it off, so `status` never weighs a stale condition against a report."""

    def __init__(
        self,
        kube: Kube,
        region: str,
        *,
        known: Callable[[MapKey], bool],
        has_condition: Callable[[MapKey], bool] = lambda key: False,
        namespaces: tuple[str, ...] = (),
        wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        concurrency: int = 8,
    ) -> None:
        self._kube = kube
        self.region = region
        self._known = known
        self._has_condition = has_condition
        # Maps whose leftover condition was taken off (the watch shows it until its event comes).
        self._conditions_removed: set[MapKey] = set()
        self._cleanup_problem: str | None = None
        self._namespaces = namespaces
        self._wall_clock = wall_clock
        self._concurrency = concurrency
        self._field_manager = status.field_manager(region)
        self._shards: dict[ShardId, _Shard] = {}
        self._where: dict[MapKey, int] = {}
        self._started = False
        self._swept = False
        self.writes = 0  # requests that changed a RegionReport, for tests and benchmarks

    # --- reading ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Read this region's RegionReports, so a restart rewrites only verdicts that changed, and
        each write compares with what the server holds. Raises SinkUnavailable."""
        shards: dict[ShardId, _Shard] = {}
        where: dict[MapKey, int] = {}
        try:
            async for page in report_pages(self._kube, self._namespaces, f"{REGION_LABEL}={self.region}"):
                for raw in page:
                    self._load(raw, shards, where)
        except KubeError as exc:
            raise status.SinkUnavailable(unavailable(exc)) from exc
        self._shards, self._where = shards, where
        self._started = True
        self._swept = False

    def stale(self) -> None:
        self._started = False
        self._conditions_removed.clear()

    def _load(self, raw: Mapping[str, Any], shards: dict[ShardId, _Shard], where: dict[MapKey, int]) -> None:
        parsed = parse_report(raw)
        if parsed is None or parsed[0] != self.region:
            return
        namespace = raw["metadata"].get("namespace", "default")
        index = parsed[1]
        entries = {name: dict(raw["maps"][name]) for name in parsed[2]}
        shards[(namespace, index)] = _Shard(entries, raw["metadata"].get("resourceVersion"))
        for name in entries:
            # A map in two shards (two writers of one region at a leader change) keeps its first
            # place; the other shard drops it at its next write.
            where.setdefault(MapKey(namespace, name), index)

    def verdict(self, key: MapKey) -> RecordedVerdict | None:
        """What this region's report says of `key`, as last read or written."""
        index = self._where.get(key)
        entry = self._shards[(key.namespace, index)].entries.get(key.name) if index is not None else None
        return parse_entry(self.region, entry) if entry is not None else None

    # --- writing ------------------------------------------------------------------------------

    async def write(self, verdicts: Mapping[MapKey, status.Verdict | None]) -> Mapping[MapKey, str]:
        """Write the shards whose verdicts changed, one request each (None: the map is gone).
        Returns the keys that failed, with a one-line reason; the caller retries them. Reads this
        region's RegionReports first when they may have changed (`stale`, and at start); raises
        SinkUnavailable when they cannot be read (a missing CRD delays status, never the gateway)."""
        if not self._started:
            await self.start()
        if not self._swept:
            self._swept = True
            gone = {key: None for key in self._where if key not in verdicts and not self._known(key)}
            verdicts = {**gone, **verdicts}
        now = self._wall_clock()
        drafts: dict[ShardId, dict[str, dict[str, Any]]] = {}
        placed: dict[ShardId, set[str]] = {}
        members: dict[ShardId, list[MapKey]] = {}
        # Per namespace, where the search for room starts: every shard below it is full. Without
        # it, placing the 10,000 maps of a first write looked at 6 million shards (1.2 s of CPU).
        room_from: dict[str, int] = {}
        for key, verdict in verdicts.items():
            index = self._where.get(key)
            if verdict is None:
                if index is not None:
                    self._draft(drafts, key.namespace, index).pop(key.name, None)
                    members.setdefault((key.namespace, index), []).append(key)
                    room_from[key.namespace] = min(room_from.get(key.namespace, 0), index)
                continue
            existing = self._shards[(key.namespace, index)].entries.get(key.name) if index is not None else None
            if existing is not None and verdict.uid and existing.get(_UID) not in (None, verdict.uid):
                existing = None  # about a map of the same name deleted before this one was made
            entry = _entry_for(verdict, self.region, existing, now)
            if entry is None:
                continue
            if index is None:
                index = room_from[key.namespace] = self._place(key.namespace, drafts, room_from.get(key.namespace, 0))
                placed.setdefault((key.namespace, index), set()).add(key.name)
            self._draft(drafts, key.namespace, index)[key.name] = entry
            members.setdefault((key.namespace, index), []).append(key)
        failed: dict[MapKey, str] = {}
        semaphore = asyncio.Semaphore(self._concurrency)

        async def write_shard(shard_id: ShardId) -> None:
            async with semaphore:
                problem = await self._write_shard(shard_id, drafts[shard_id], placed.get(shard_id, set()))
            if problem is not None:
                failed.update((key, problem) for key in members[shard_id])

        async def remove_condition(key: MapKey) -> None:
            async with semaphore:
                await self._remove_condition(key)

        async with asyncio.TaskGroup() as group:
            for shard_id in drafts:
                group.create_task(write_shard(shard_id))
            for key, verdict in verdicts.items():
                if verdict is not None and key not in self._conditions_removed and self._has_condition(key):
                    group.create_task(remove_condition(key))
        return failed

    async def _remove_condition(self, key: MapKey) -> None:
        """Take this region's condition (left from condition mode) off the map: an apply of no
        conditions under the region's field manager removes only what it owned."""
        try:
            await status.remove_condition(self._kube, key, self.region)
        except KubeError as exc:
            problem = f"cannot take this region's condition (left from condition mode) off TrafficMaps: {exc}"
            if problem != self._cleanup_problem:
                log.warning("status leftover kept", extra={"map": str(key), "error": problem})
            self._cleanup_problem = problem
            return
        self._conditions_removed.add(key)

    def _draft(self, drafts: dict[ShardId, dict[str, dict[str, Any]]], namespace: str, index: int) -> dict[str, dict[str, Any]]:
        """The shard's next entries: what the server holds, less maps whose place is elsewhere."""
        shard_id = (namespace, index)
        if shard_id not in drafts:
            shard = self._shards.get(shard_id) or _Shard()
            drafts[shard_id] = {
                name: entry for name, entry in shard.entries.items() if self._where.get(MapKey(namespace, name)) == index
            }
        return drafts[shard_id]

    def _place(self, namespace: str, drafts: Mapping[ShardId, Mapping[str, Any]], start: int) -> int:
        """The lowest shard of `namespace` from `start` on with room for one more map: shards fill
        densely, and a place freed by a deleted map is taken by the next new one."""
        index = start
        while True:
            shard_id = (namespace, index)
            entries = drafts.get(shard_id)
            if entries is None:
                shard = self._shards.get(shard_id)
                entries = shard.entries if shard is not None else {}
            if len(entries) < SHARD_ENTRIES:
                return index
            index += 1

    async def _write_shard(self, shard_id: ShardId, entries: dict[str, dict[str, Any]], placed: set[str]) -> str | None:
        """One request for one shard; on success the shard and the places of its maps are
        remembered. Returns None, or why it failed (after a conflict, the shard is read again)."""
        namespace, index = shard_id
        shard = self._shards.get(shard_id) or _Shard()
        if entries == shard.entries:
            self._remember(shard_id, shard, placed)
            return None
        name = shard_name(self.region, index)
        path = REGION_REPORTS.path(namespace, name)
        try:
            if not entries:
                if shard.resource_version is not None:
                    options = {"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": {"resourceVersion": shard.resource_version}}
                    await self._kube.request("DELETE", path, body=options)
                stored = _Shard()
            elif shard.resource_version is None:
                created = await self._kube.request(
                    "POST", REGION_REPORTS.path(namespace), query={"fieldManager": self._field_manager},
                    body=report_object(self.region, namespace, index, entries),
                )
                stored = _Shard(entries, created["metadata"]["resourceVersion"])
            else:
                body = report_object(self.region, namespace, index, entries)
                body["metadata"]["resourceVersion"] = shard.resource_version
                applied = await self._kube.apply(REGION_REPORTS, body, field_manager=self._field_manager)
                stored = _Shard(entries, applied["metadata"]["resourceVersion"])
        except KubeError as exc:
            if exc.conflict or exc.not_found:
                # Another instance of this region wrote it (or removed it): read what it holds.
                await self._reread(shard_id)
            return f"RegionReport {namespace}/{name}: {exc}"
        self.writes += 1
        metrics.STATUS_WRITES.labels(result="written").inc()
        self._remember(shard_id, stored, placed)
        return None

    def _remember(self, shard_id: ShardId, stored: _Shard, placed: set[str]) -> None:
        namespace, index = shard_id
        previous = self._shards.get(shard_id)
        for name in previous.entries if previous is not None else ():
            key = MapKey(namespace, name)
            if name not in stored.entries and self._where.get(key) == index:
                del self._where[key]
        for name in stored.entries:
            if name in placed or MapKey(namespace, name) not in self._where:
                self._where[MapKey(namespace, name)] = index
        if stored.resource_version is None and not stored.entries:
            self._shards.pop(shard_id, None)
        else:
            self._shards[shard_id] = stored

    async def _reread(self, shard_id: ShardId) -> None:
        namespace, index = shard_id
        try:
            raw = await self._kube.get(REGION_REPORTS, namespace, shard_name(self.region, index))
        except KubeError as exc:
            if exc.not_found:
                self._remember(shard_id, _Shard(), set())
            return  # any other failure: the next attempt meets the conflict again and retries this
        parsed = parse_report(raw)
        entries = {name: dict(raw["maps"][name]) for name in parsed[2]} if parsed is not None else {}
        self._remember(shard_id, _Shard(entries, raw["metadata"].get("resourceVersion")), set())


def _entry_for(verdict: status.Verdict, region: str, existing: Mapping[str, Any] | None, now: datetime) -> dict[str, Any] | None:
    """The entry to store, or None when `existing` already says the same of the same map: the
    condition mode's rules (status.condition_for), with the message cut to MAX_MESSAGE."""
    short = status.Verdict(verdict.published, verdict.reason, verdict.message[:MAX_MESSAGE], verdict.generation, verdict.uid)
    current = None
    if existing is not None:
        try:
            current = validate(Condition, {"type": "x", **{k: existing[k] for k in _ENTRY_FIELDS if k in existing}})
        except ValidationError:
            current = None
    condition = status.condition_for(short, region, current, now)
    if condition is None:
        if existing is None or not verdict.uid or existing.get(_UID) == verdict.uid:
            return None
        condition = dict(existing)  # the same facts, now with the map's uid
    entry = {name: condition[name] for name in _ENTRY_FIELDS if name in condition}
    if verdict.uid:
        entry[_UID] = verdict.uid
    return entry
