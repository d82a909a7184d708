"""The fleet view behind `ome-publisher status`: per map, OME's generation and each region's verdict.

A region says what it serves either as a condition on the TrafficMap (`--status-mode condition`) or
as an entry of its RegionReport beside the map (`report`); this module reads both, so a fleet whose
regions use different modes (or one that is switching) is one table. `fleet_view` is pure (raw
objects in, MapStatus out); `read_fleet` does the two lists, and `forget_region` removes what a
region that is gone left behind, in both modes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from publisher.status import region_report

from publisher import status
from publisher.kube import TRAFFIC_MAPS, Kube, KubeError
from publisher.core.values import CONDITION_PREFIX, MapKey, condition_type
from publisher.status.region_report import RecordedVerdict

# Lists of this many maps a page, as the source reads them.
_PAGE = 500


@dataclass(frozen=True, slots=True)
class MapStatus:
    """One map: its generation (what OME last wrote), and each region's verdict (None: that region
    has said nothing about this map)."""

    key: MapKey
    generation: int
    verdicts: Mapping[str, RecordedVerdict | None]

    @property
    def published(self) -> bool:
        """Every region serves the current generation (and there is at least one region)."""
        return bool(self.verdicts) and all(v is not None and v.published(self.generation) for v in self.verdicts.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "namespace": self.key.namespace,
            "name": self.key.name,
            "generation": self.generation,
            "published": self.published,
            "regions": [_verdict_json(region, verdict, self.generation) for region, verdict in self.verdicts.items()],
        }


def _verdict_json(region: str, verdict: RecordedVerdict | None, generation: int) -> dict[str, Any]:
    if verdict is None:
        return {"region": region, "mode": None, "published": False, "observedGeneration": None, "status": None,
                "reason": None, "message": None, "lastTransitionTime": None}
    return {
        "region": region,
        "mode": verdict.mode,
        "published": verdict.published(generation),
        "observedGeneration": verdict.observed_generation,
        "status": verdict.status,
        "reason": verdict.reason,
        "message": verdict.message,
        "lastTransitionTime": verdict.last_transition_time,
    }


def _newer(a: RecordedVerdict | None, b: RecordedVerdict) -> RecordedVerdict:
    """Of a region's two verdicts on one map (it changed modes), the one about the later generation,
    then the later transition; a report wins a tie, being the mode a region switches to."""
    if a is None:
        return b
    rank_a = (a.observed_generation or 0, a.last_transition_time, a.mode == "report")
    rank_b = (b.observed_generation or 0, b.last_transition_time, b.mode == "report")
    return b if rank_b > rank_a else a


def fleet_view(
    maps: Iterable[Mapping[str, Any]],
    reports: Iterable[Mapping[str, Any]],
    *,
    names: frozenset[str] = frozenset(),
    regions: Iterable[str] = (),
) -> list[MapStatus]:
    """Every map (only those named, when `names` is given) with a verdict per region, in key order.
    The regions are `regions` and every region seen on any map or report read."""
    found: dict[MapKey, dict[str, RecordedVerdict]] = {}
    generations: dict[MapKey, int] = {}
    uids: dict[MapKey, str] = {}
    known_regions = set(regions)
    for raw in maps:
        metadata = raw.get("metadata") or {}
        key = MapKey(str(metadata.get("namespace", "default")), str(metadata.get("name", "")))
        generation = metadata.get("generation")
        generations[key] = generation if isinstance(generation, int) else 0
        uids[key] = str(metadata.get("uid") or "")
        verdicts = found.setdefault(key, {})
        conditions = (raw.get("status") or {}).get("conditions") or []
        for condition in conditions if isinstance(conditions, list) else ():
            kind = condition.get("type") if isinstance(condition, dict) else None
            if not isinstance(kind, str) or not kind.startswith(CONDITION_PREFIX):
                continue
            region = kind[len(CONDITION_PREFIX):]
            verdict = region_report.parse_entry(region, condition, mode="condition")
            if verdict is not None:
                known_regions.add(region)
                verdicts[region] = _newer(verdicts.get(region), verdict)
    for raw in reports:
        parsed = region_report.parse_report(raw)
        if parsed is None:
            continue
        region, _, entries = parsed
        known_regions.add(region)
        namespace = str((raw.get("metadata") or {}).get("namespace", "default"))
        for name, verdict in entries.items():
            key = MapKey(namespace, name)
            # A report on a map that is gone, or on an older map of the same name, says nothing.
            if key in found and verdict.about(uids[key]):
                found[key][region] = _newer(found[key].get(region), verdict)
    ordered_regions = sorted(known_regions)
    return [
        MapStatus(key, generations[key], {region: found[key].get(region) for region in ordered_regions})
        for key in sorted(found)
        if not names or key.name in names
    ]


async def _list_maps(kube: Kube, namespaces: tuple[str, ...]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for namespace in namespaces or (None,):
        token: str | None = None
        while True:
            page = await kube.list(TRAFFIC_MAPS, namespace=namespace, limit=_PAGE, continue_token=token)
            items.extend(page.get("items") or [])
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                break
    return items


async def read_reports(kube: Kube, namespaces: tuple[str, ...] = ()) -> tuple[list[dict[str, Any]], str | None]:
    """The RegionReports, and what could not be read: a fleet without the CRD (condition mode
    only, a supported setup) has none; one that may not read them (403) is told so in one line.
    Raises KubeError for any other failure."""
    try:
        return await region_report.list_reports(kube, namespaces), None
    except KubeError as exc:
        return [], _not_read(exc)


def _not_read(exc: KubeError) -> str | None:
    """What a failed read of RegionReports means: none at all without the CRD (None), one line
    to show when they may not be read (403); any other failure is raised again."""
    if exc.not_found:
        return None
    if exc.code == 403:
        return f"RegionReports not read ({exc}): regions in report mode are not shown"
    raise exc


async def read_fleet(
    kube: Kube, namespaces: tuple[str, ...] = (), *, names: frozenset[str] = frozenset(), regions: Iterable[str] = ()
) -> tuple[list[MapStatus], str | None]:
    """The maps and every region's RegionReports in `namespaces` (all when empty), as fleet_view
    sees them, and what could not be read (see read_reports). Raises KubeError."""
    maps = await _list_maps(kube, namespaces)
    reports, unread = await read_reports(kube, namespaces)
    return fleet_view(maps, reports, names=names, regions=regions), unread


@dataclass(frozen=True, slots=True)
class Forgotten:
    """What --forget-region removed, and what it could not read (None: everything was read)."""

    reports: int
    conditions: int
    unread: str | None


async def forget_region(kube: Kube, region: str, namespaces: tuple[str, ...] = ()) -> Forgotten:
    """What a removed region left: its RegionReports are deleted and its condition is taken off
    every map (an apply of no conditions under its field manager removes only what it owned).
    No CRD means no reports. Raises KubeError."""
    unread = None
    try:
        reports = await region_report.forget_region(kube, region, namespaces)
    except KubeError as exc:
        reports, unread = 0, _not_read(exc)
    own_type = condition_type(region)
    removed = 0
    for raw in await _list_maps(kube, namespaces):
        conditions = (raw.get("status") or {}).get("conditions") or []
        if not any(isinstance(c, dict) and c.get("type") == own_type for c in conditions):
            continue
        metadata = raw["metadata"]
        if await status.remove_condition(kube, MapKey(metadata.get("namespace", "default"), metadata["name"]), region):
            removed += 1
    return Forgotten(reports, removed, unread)


async def regions_seen(kube: Kube, namespaces: tuple[str, ...] = ()) -> list[str]:
    """Every region that has a condition or a RegionReport in `namespaces`: what a mistyped
    region name is told to pick from."""
    view, _ = await read_fleet(kube, namespaces)
    return sorted({region for item in view for region in item.verdicts})
