"""The report status mode's sink against the fake API server over real HTTP: verdicts written once,
sharded, garbage collected, never overwritten by another writer, and nothing rewritten on restart."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import sys
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import pytest

from adapters import ADAPTERS
from adapters.json import JsonOptions
from publisher.cli import app
from publisher import loop
from publisher.cli.config import RunConfig
from publisher.kube import Kube
from publisher.loop import LeaderOptions, LoopOptions, Publisher
from publisher.core.values import MapKey, Reason
from publisher.status.region_report import MAX_MESSAGE, SHARD_ENTRIES, RegionReportSink, forget_region
from publisher.source.informer import WatchOptions
from publisher.source.kube_source import KubeSource
from publisher.source.store import Stores
from publisher.status import Verdict
from tests.builders import make_isvc, make_map
from tests.fakes.kube_api import FakeKubeAPI, write_kubeconfig
from tests.gateways import eventually, free_port

RR = "gateway-publisher.ome.io/v1alpha1/regionreports"
NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
LATER = datetime(2026, 12, 1, 12, 5, 0, tzinfo=UTC)


def published(generation: int = 1, message: str = "served") -> Verdict:
    return Verdict(True, Reason.PUBLISHED, message, generation)


def held(generation: int = 1) -> Verdict:
    return Verdict(False, Reason.ROUTABLE_OUTDATED, "waiting for Routable", generation)


def keys(n: int, namespace: str = "prod") -> list[MapKey]:
    return [MapKey(namespace, f"map-{i:03}") for i in range(n)]


@pytest.fixture
async def kube(kubeconfig: Path) -> AsyncIterator[Kube]:
    client = await Kube.connect(kubeconfig)
    try:
        yield client
    finally:
        await client.close()


def sink_for(kube: Kube, region: str = "eu", *, known: Callable[[MapKey], bool] = lambda key: True,
             clock: Callable[[], datetime] = lambda: NOW) -> RegionReportSink:
    return RegionReportSink(kube, region, known=known, wall_clock=clock)


def writes(api: FakeKubeAPI) -> int:
    return sum(api.count(verb) for verb in ("create", "patch", "update", "delete"))


def stored(api: FakeKubeAPI, region: str = "eu") -> dict[tuple[str, str], dict]:
    """Every verdict of `region` on the server, by (namespace, map name)."""
    found: dict[tuple[str, str], dict] = {}
    for obj in api.objects(RR):
        if obj["region"] == region:
            for name, entry in obj["maps"].items():
                assert (obj["metadata"]["namespace"], name) not in found, "a map in two shards"
                found[(obj["metadata"]["namespace"], name)] = entry
    return found


async def test_verdicts_are_written_once_with_the_facts_of_the_condition(kube_api, kube):
    sink = sink_for(kube)
    await sink.start()
    chat, embed = MapKey("prod", "chat"), MapKey("prod", "embed")
    assert await sink.write({chat: published(3), embed: held(2)}) == {}
    assert writes(kube_api) == 1  # one shard, one request
    (obj,) = kube_api.objects(RR)
    assert obj["metadata"]["name"] == "eu-0" and obj["metadata"]["namespace"] == "prod"
    assert obj["metadata"]["labels"] == {"gateway-publisher.ome.io/region": "eu"} and obj["region"] == "eu"
    assert obj["maps"] == {
        "chat": {"observedGeneration": 3, "status": "True", "reason": "Published", "message": "served",
                 "lastTransitionTime": "2026-12-01T12:00:00Z"},
        "embed": {"observedGeneration": 2, "status": "False", "reason": "RoutableOutdated",
                  "message": "waiting for Routable", "lastTransitionTime": "2026-12-01T12:00:00Z"},
    }
    # The same verdicts again: nothing to write.
    assert await sink.write({chat: published(3), embed: held(2)}) == {}
    assert writes(kube_api) == 1


async def test_only_a_changed_verdict_is_written_and_its_time_moves_with_status(kube_api, kube):
    now = [NOW]
    sink = sink_for(kube, clock=lambda: now[0])
    await sink.start()
    chat = MapKey("prod", "chat")
    await sink.write({chat: held(1)})
    now[0] = LATER
    await sink.write({chat: Verdict(False, Reason.ROUTABLE_OUTDATED, "still waiting", 1)})
    assert stored(kube_api)[("prod", "chat")]["lastTransitionTime"] == "2026-12-01T12:00:00Z"
    await sink.write({chat: published(2)})
    entry = stored(kube_api)[("prod", "chat")]
    assert (entry["status"], entry["observedGeneration"], entry["lastTransitionTime"]) == ("True", 2, "2026-12-01T12:05:00Z")
    assert writes(kube_api) == 3


async def test_shards_hold_at_most_shard_entries_maps_of_one_namespace(kube_api, kube):
    sink = sink_for(kube)
    await sink.start()
    many = keys(2 * SHARD_ENTRIES + 6) + keys(3, "dev")
    long_message = "x" * (MAX_MESSAGE * 4)
    assert await sink.write({key: published(1, long_message) for key in many}) == {}
    objects = kube_api.objects(RR)
    # One request per shard: two full and one of 6 in prod, one of 3 in dev.
    assert writes(kube_api) == len(objects) == 4
    assert sorted((o["metadata"]["namespace"], o["metadata"]["name"], len(o["maps"])) for o in objects) == [
        ("dev", "eu-0", 3), ("prod", "eu-0", SHARD_ENTRIES), ("prod", "eu-1", SHARD_ENTRIES), ("prod", "eu-2", 6),
    ]
    assert set(stored(kube_api)) == {(key.namespace, key.name) for key in many}
    # Bounded: a message is cut, so a full shard stays far under etcd's 1.5 MiB request limit.
    assert all(len(entry["message"]) == MAX_MESSAGE for entry in stored(kube_api).values())
    assert max(len(json.dumps(o)) for o in objects) < 16 * 1024


async def test_a_deleted_map_leaves_its_shard_and_an_empty_shard_is_deleted(kube_api, kube):
    sink = sink_for(kube)
    await sink.start()
    maps = keys(SHARD_ENTRIES + 1)
    await sink.write({key: published() for key in maps})
    last = maps[-1]  # alone in eu-1
    assert await sink.write({maps[0]: None, last: None}) == {}
    assert sorted(o["metadata"]["name"] for o in kube_api.objects(RR)) == ["eu-0"]
    assert ("prod", maps[0].name) not in stored(kube_api) and len(stored(kube_api)) == SHARD_ENTRIES - 1
    # The place freed in eu-0 is the next new map's.
    newcomer = MapKey("prod", "newcomer")
    await sink.write({newcomer: published()})
    assert sorted(o["metadata"]["name"] for o in kube_api.objects(RR)) == ["eu-0"]
    assert ("prod", "newcomer") in stored(kube_api)


async def test_placing_new_maps_looks_at_each_shard_about_once(kube_api, kube):
    """Issue 29: each new map's place was searched for from shard 0, so a first write at 10,000
    maps looked at 6 million shards and held the event loop 475 ms (benchmarks/compare.py
    --status-mode report). Counted here as the shards `_place` looks at, by a trace."""
    looked = 0
    code = RegionReportSink._place.__code__
    step = code.co_firstlineno + next(i for i, line in enumerate(inspect.getsource(RegionReportSink._place).splitlines())
                                      if "shard_id = (namespace, index)" in line)

    def trace(frame, event, arg):
        if frame.f_code is not code:
            return None

        def line(frame, event, arg):
            nonlocal looked
            looked += event == "line" and frame.f_lineno == step
            return line

        return line

    sink = sink_for(kube)
    await sink.start()
    maps = keys(100 * SHARD_ENTRIES)
    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        assert await sink.write({key: published() for key in maps}) == {}
    finally:
        sys.settrace(previous)
    assert len(kube_api.objects(RR)) == 100 and len(stored(kube_api)) == len(maps)
    assert len(maps) <= looked <= len(maps) + 100
    # A place freed in the same write is still the next new map's, wherever the search had got to.
    first, second = MapKey("prod", "new-1"), MapKey("prod", "new-2")
    assert await sink.write({first: published(), maps[0]: None, second: published()}) == {}
    places = {(o["metadata"]["name"], name) for o in kube_api.objects(RR) for name in o["maps"]}
    assert ("eu-100", "new-1") in places and ("eu-0", "new-2") in places


async def test_a_read_of_the_reports_loads_each_page_before_it_asks_for_the_next(kube_api, kube, monkeypatch):
    """Issue 29: at each resync the sink listed all of its region's reports, then loaded them in
    one go (1,250 at 10,000 maps: the event loop held 150 ms, benchmarks/compare.py --status-mode
    report). Loaded a page at a time, the loop is free while each next page is on its way."""
    maps = keys(130 * SHARD_ENTRIES)
    writer = sink_for(kube)
    await writer.start()
    assert await writer.write({key: published() for key in maps}) == {}
    loaded_after: list[int] = []  # per list request, the reports loaded before the next one
    list_page, load = kube.list, RegionReportSink._load

    async def counted_list(*args, **kwargs):
        loaded_after.append(0)
        return await list_page(*args, **kwargs)

    def counted_load(self, *args):
        loaded_after[-1] += 1
        return load(self, *args)

    monkeypatch.setattr(kube, "list", counted_list)
    monkeypatch.setattr(RegionReportSink, "_load", counted_load)
    reader = sink_for(kube)
    await reader.start()
    assert loaded_after == [100, 30]
    assert all(reader.verdict(key) is not None for key in maps)


async def test_a_restart_writes_nothing_and_forgets_maps_gone_while_down(kube_api, kube):
    maps = keys(40)
    first = sink_for(kube)
    await first.start()
    await first.write({key: published() for key in maps})
    before = writes(kube_api)
    restarted = sink_for(kube, clock=lambda: LATER)
    await restarted.start()
    assert restarted.verdict(maps[0]) is not None and restarted.verdict(maps[0]).published(1)
    assert await restarted.write({key: published() for key in maps}) == {}
    assert writes(kube_api) == before  # the same verdicts: not one request
    # A map deleted while no instance ran is dropped at the first write after the first full view.
    gone = maps[5]
    again = sink_for(kube, known=lambda key: key != gone)
    await again.start()
    assert await again.write({maps[0]: published()}) == {}
    assert ("prod", gone.name) not in stored(kube_api) and len(stored(kube_api)) == 39
    assert writes(kube_api) == before + 1


async def test_regions_writing_at_once_never_overwrite_each_other(kube_api, kube):
    regions = [f"region-{i}" for i in range(5)]
    sinks = [sink_for(kube, region) for region in regions]
    await asyncio.gather(*(sink.start() for sink in sinks))
    maps = keys(SHARD_ENTRIES + 8)
    for round_ in range(1, 4):
        results = await asyncio.gather(*(
            sink.write({key: published(round_, f"{sink.region} round {round_}") for key in maps}) for sink in sinks
        ))
        assert all(result == {} for result in results)
    for region in regions:
        verdicts = stored(kube_api, region)
        assert len(verdicts) == len(maps)
        assert {entry["message"] for entry in verdicts.values()} == {f"{region} round 3"}
    # Each region wrote only its own objects, under its own field manager.
    for obj in kube_api.objects(RR):
        managers = {m["manager"] for m in obj["metadata"]["managedFields"]}
        assert managers == {f"ome-gateway-publisher-{obj['region']}"}


async def test_a_stale_writer_of_the_same_region_gets_a_conflict_not_an_overwrite(kube_api, kube):
    """Two instances of one region (a leader change): the one whose view is older is refused,
    re-reads the shard, and its retry keeps what the other wrote."""
    old_leader, new_leader = sink_for(kube), sink_for(kube)
    await old_leader.start()
    await new_leader.start()
    chat, embed = MapKey("prod", "chat"), MapKey("prod", "embed")
    assert await new_leader.write({chat: published(2)}) == {}
    failed = await old_leader.write({embed: held(1)})
    assert set(failed) == {embed} and "409" in failed[embed]
    assert stored(kube_api) == {("prod", "chat"): stored(kube_api)[("prod", "chat")]}
    assert await old_leader.write({embed: held(1)}) == {}  # the caller's retry, on the shard it re-read
    assert set(stored(kube_api)) == {("prod", "chat"), ("prod", "embed")}
    # The other way round: an apply from a stale resourceVersion is refused too.
    failed = await new_leader.write({chat: held(3)})
    assert set(failed) == {chat}
    assert stored(kube_api)[("prod", "chat")]["status"] == "True"
    assert await new_leader.write({chat: held(3)}) == {}
    assert set(stored(kube_api)) == {("prod", "chat"), ("prod", "embed")}
    assert stored(kube_api)[("prod", "chat")]["status"] == "False"


async def test_a_failed_write_is_reported_and_retried_from_what_the_server_holds(kube_api, kube):
    sink = sink_for(kube)
    await sink.start()
    chat = MapKey("prod", "chat")
    kube_api.fail_next(1, 500, verb="create")
    failed = await sink.write({chat: published()})
    assert set(failed) == {chat} and "500" in failed[chat]
    assert kube_api.objects(RR) == []
    assert await sink.write({chat: published()}) == {}
    assert set(stored(kube_api)) == {("prod", "chat")}


async def test_forgetting_a_region_deletes_its_reports_and_only_its(kube_api, kube):
    for region in ("eu", "us"):
        sink = sink_for(kube, region)
        await sink.start()
        await sink.write({key: published() for key in keys(SHARD_ENTRIES + 1) + keys(2, "dev")})
    assert await forget_region(kube, "eu") == 3
    assert {o["region"] for o in kube_api.objects(RR)} == {"us"} and len(kube_api.objects(RR)) == 3
    assert await forget_region(kube, "us", ("dev",)) == 1
    assert {o["metadata"]["namespace"] for o in kube_api.objects(RR)} == {"prod"}


# --- the sidecar in report mode ------------------------------------------------------------------

TM = "ome.io/v1beta1/trafficmaps"


def seed_maps(api: FakeKubeAPI, names: list[str], namespace: str = "prod") -> None:
    for name in names:
        isvc = api.create(make_isvc(name, namespace=namespace))
        api.create(make_map(name, namespace=namespace, generation=1, isvc_uid=isvc["metadata"]["uid"], observed_isvc_generation=1))


async def test_the_sidecar_in_report_mode_writes_reports_and_no_condition(kube_api, kubeconfig, tmp_path):
    seed_maps(kube_api, ["chat", "embed"])
    config = RunConfig(kubeconfig=kubeconfig, adapter="json", json_path=tmp_path / "out.json", once=True, region="eu", status_mode="report")
    summary = await app.run(config)
    assert summary is not None and summary.all_published
    assert kube_api.count("patch", path="/apis/ome.io/v1beta1/namespaces/prod/trafficmaps/chat/status") == 0
    assert all(c["type"] != "gateway-publisher.ome.io/eu" for c in kube_api.get(TM, "prod", "chat")["status"]["conditions"])
    assert {name: (e["status"], e["reason"], e["observedGeneration"]) for (_, name), e in stored(kube_api).items()} == {
        "chat": ("True", "Published", 1), "embed": ("True", "Published", 1),
    }
    assert writes(kube_api) == 1  # both verdicts in one shard, one request
    # Run again: the same verdicts, nothing written.
    await app.run(config)
    assert writes(kube_api) == 1


async def test_a_running_sidecar_removes_a_deleted_maps_verdict(kube_api, kubeconfig, tmp_path):
    seed_maps(kube_api, ["chat", "embed"])
    client = await Kube.connect(kubeconfig)
    stores = Stores.empty()
    sink = RegionReportSink(client, "eu", known=lambda key: stores.maps.get(key) is not None)
    publisher = Publisher(stores, ADAPTERS["json"].engine("json", JsonOptions(json_path=tmp_path / "out.json")),
                          LoopOptions(region="eu", resync=3600), status_sink=sink)
    source = KubeSource(client, stores, publisher, WatchOptions(backoff_initial=0.05, silence_timeout=5), clock=publisher.clock)
    task = asyncio.create_task(loop.run(publisher, source, kube=client))
    try:
        await eventually(lambda: set(stored(kube_api)) == {("prod", "chat"), ("prod", "embed")})
        kube_api.delete(TM, "prod", "embed")
        await eventually(lambda: set(stored(kube_api)) == {("prod", "chat")})
        kube_api.delete(TM, "prod", "chat")
        await eventually(lambda: kube_api.objects(RR) == [])  # the last map gone: its shard too
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()


@contextlib.asynccontextmanager
async def sidecar(kubeconfig: Path, out: Path, *, leader: LeaderOptions | None = None) -> AsyncIterator[tuple[Publisher, RegionReportSink]]:
    """Region eu's sidecar in report mode, running until the block ends."""
    client = await Kube.connect(kubeconfig)
    stores = Stores.empty()
    sink = RegionReportSink(client, "eu", known=lambda key: stores.maps.get(key) is not None)
    publisher = Publisher(stores, ADAPTERS["json"].engine("json", JsonOptions(json_path=out)),
                          LoopOptions(region="eu", resync=3600), status_sink=sink)
    source = KubeSource(client, stores, publisher, WatchOptions(backoff_initial=0.05, silence_timeout=5), clock=publisher.clock)
    task = asyncio.create_task(loop.run(publisher, source, leader=leader, kube=client))
    try:
        yield publisher, sink
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()


async def test_of_two_leader_elected_replicas_only_the_leader_writes_reports(kube_api, kubeconfig, tmp_path):
    seed_maps(kube_api, ["chat"])
    fast = dict(lease_duration=4, renew_deadline=3, retry_period=1)
    async with sidecar(kubeconfig, tmp_path / "a.json", leader=LeaderOptions("prod", "replica-a", **fast)) as (a, sink_a), \
            sidecar(kubeconfig, tmp_path / "b.json", leader=LeaderOptions("prod", "replica-b", **fast)) as (b, sink_b):
        await eventually(lambda: ("prod", "chat") in stored(kube_api))
        assert a.outbox.leading != b.outbox.leading
        leader, follower = (sink_a, sink_b) if a.outbox.leading else (sink_b, sink_a)
        current = kube_api.get(TM, "prod", "chat")
        current["spec"]["entries"][0]["probe"] = {"result": "Passed"}
        bumped = kube_api.update(current)
        for condition in bumped["status"]["conditions"]:
            condition["observedGeneration"] = bumped["metadata"]["generation"]
        bumped["status"]["observedTrafficMapGeneration"] = bumped["metadata"]["generation"]
        kube_api.update(bumped)
        await eventually(lambda: stored(kube_api)[("prod", "chat")]["observedGeneration"] == 2)
        # The leader wrote the first verdict and the new one; the follower nothing.
        assert leader.writes >= 2 and follower.writes == 0


# --- what report mode needs is missing at start (issue 27, item 9) ------------------------------

CRD_MISSING = "the CRD regionreports.gateway-publisher.ome.io is not installed"


async def _uninstall(api: FakeKubeAPI) -> None:
    api.uninstall("regionreports")


async def _install(api: FakeKubeAPI) -> None:
    api.install("regionreports")


async def _forbid(api: FakeKubeAPI) -> None:
    api.refuse(403, resource="regionreports")


async def _allow(api: FakeKubeAPI) -> None:
    api.allow()


async def _too_many(api: FakeKubeAPI) -> None:
    api.fail_next(1, 429, verb="list")


async def _internal_error(api: FakeKubeAPI) -> None:
    api.fail_next(1, 500, verb="list")


async def _down(api: FakeKubeAPI) -> None:
    await api.go_down()


async def _back(api: FakeKubeAPI) -> None:
    await api.come_back()


# (break it, heal it (None: it heals itself), what /readyz and the log say meanwhile)
START_FAULTS = {
    "crd-not-installed": (_uninstall, _install, [CRD_MISSING, "helm show crds"]),
    "rbac-without-regionreports": (_forbid, _allow, ["not allowed to read regionreports.gateway-publisher.ome.io", "403 Forbidden"]),
    "one-429": (_too_many, None, ["429 TooManyRequests"]),
    "one-500": (_internal_error, None, ["500 InternalError"]),
    "api-server-not-reachable-yet": (_down, _back, ["cannot read this region's RegionReports", "ClientConnectorError"]),
}


@pytest.mark.parametrize("fault", list(START_FAULTS))
async def test_report_mode_keeps_serving_the_gateway_when_its_reports_cannot_be_read(kube_api, kubeconfig, tmp_path, caplog, fault):
    """The reports live on a second fake API server here, so a fault hits them and not the source."""
    caplog.set_level(logging.INFO, logger="publisher.loop")
    seed_maps(kube_api, ["chat"])
    brk, heal, said = START_FAULTS[fault]
    async with FakeKubeAPI() as reports_api:
        reports_client = await Kube.connect(write_kubeconfig(tmp_path / "reports-kubeconfig", reports_api.url))
        client = await Kube.connect(kubeconfig)
        await brk(reports_api)
        stores = Stores.empty()
        sink = RegionReportSink(reports_client, "eu", known=lambda key: stores.maps.get(key) is not None)
        out = tmp_path / "out.json"
        publisher = Publisher(stores, ADAPTERS["json"].engine("json", JsonOptions(json_path=out)),
                              LoopOptions(region="eu", resync=3600, backoff_base=0.05, backoff_cap=0.2), status_sink=sink)
        source = KubeSource(client, stores, publisher, WatchOptions(backoff_initial=0.05, silence_timeout=5), clock=publisher.clock)
        port = free_port()
        task = asyncio.create_task(loop.run(publisher, source, kube=client, listen=("127.0.0.1", port)))

        async def readyz() -> tuple[int, str]:
            async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/readyz") as response:
                return response.status, await response.text()

        try:
            # The gateway path does not wait for status.
            await eventually(lambda: publisher.states.get(MapKey("prod", "chat"), loop.MapState()).state == "published" and out.exists())
            assert "chat" in out.read_text()
            if heal is not None:
                # It says what is missing, in /readyz and once in the log, and retries with backoff.
                await eventually(lambda: publisher.outbox.sink_failures() >= 3)
                code, why = await readyz()
                assert code == 200 and why.startswith("ready; status is not written: ") and all(part in why for part in said), why
                assert not task.done()
                await heal(reports_api)
            await eventually(lambda: ("prod", "chat") in stored(reports_api))
            await eventually(lambda: publisher.outbox.problem is None)
            assert await readyz() == (200, "ready\n")
            assert not task.done()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.close()
            await reports_client.close()
    warnings = [r for r in caplog.records if r.getMessage() == "status not written, retrying"]
    assert len(warnings) == 1 and all(part in warnings[0].__dict__["error"] for part in said)
    assert any(r.getMessage() == "status writes resumed" for r in caplog.records)


async def test_once_in_report_mode_without_the_crd_publishes_and_says_why_no_status(kube_api, kubeconfig, tmp_path, caplog):
    kube_api.uninstall("regionreports")
    seed_maps(kube_api, ["chat"])
    config = RunConfig(kubeconfig=kubeconfig, adapter="json", json_path=tmp_path / "out.json", once=True, region="eu", status_mode="report")
    summary = await app.run(config)
    assert summary is not None and summary.all_published
    warnings = [r for r in caplog.records if r.getMessage() == "status not written, retrying"]
    assert len(warnings) == 1 and CRD_MISSING in warnings[0].__dict__["error"]


async def test_a_follower_without_the_crd_keeps_serving_and_reads_nothing(kube_api, kubeconfig, tmp_path):
    """Item 9, followers: another replica holds the Lease; this one never needs the reports."""
    kube_api.uninstall("regionreports")
    seed_maps(kube_api, ["chat"])
    kube_api.create({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "ome-gateway-publisher-eu", "namespace": "prod"},
        "spec": {"holderIdentity": "replica-a", "leaseDurationSeconds": 3600, "renewTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
                 "acquireTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")},
    })
    fast = dict(lease_duration=4, renew_deadline=3, retry_period=1)
    async with sidecar(kubeconfig, tmp_path / "b.json", leader=LeaderOptions("prod", "replica-b", **fast)) as (b, _):
        await eventually(lambda: b.states.get(MapKey("prod", "chat"), loop.MapState()).state == "published")
        await eventually(lambda: kube_api.count("get", path="/apis/coordination.k8s.io/v1/namespaces/prod/leases/ome-gateway-publisher-eu") >= 2)
        assert not b.outbox.leading and b.ready() == (True, "ready") and b.outbox.problem is None


async def test_each_mode_removes_what_its_region_left_in_the_other(kube_api, kubeconfig, tmp_path):
    """Item 12: condition -> report takes the region's condition off; report -> condition deletes its reports."""
    seed_maps(kube_api, ["chat"])
    mine = "gateway-publisher.ome.io/eu"

    async def run_in(mode: str) -> None:
        config = RunConfig(kubeconfig=kubeconfig, adapter="json", json_path=tmp_path / "out.json", once=True, region="eu", status_mode=mode)
        summary = await app.run(config)
        assert summary is not None and summary.all_published

    def conditions() -> set[str]:
        return {c["type"] for c in kube_api.get(TM, "prod", "chat")["status"]["conditions"]}

    await run_in("condition")
    assert mine in conditions() and kube_api.objects(RR) == []
    await run_in("report")
    assert mine not in conditions() and "Routable" in conditions()  # OME's own condition stays
    assert set(stored(kube_api)) == {("prod", "chat")}
    await run_in("condition")
    assert mine in conditions() and kube_api.objects(RR) == []


async def test_a_running_sidecar_repairs_a_report_deleted_or_edited_by_hand_at_its_next_resync(kube_api, kubeconfig, tmp_path):
    """Item 11: as it repairs the gateway, the resync repairs the region's reports."""
    seed_maps(kube_api, ["chat"])
    client = await Kube.connect(kubeconfig)
    stores = Stores.empty()
    sink = RegionReportSink(client, "eu", known=lambda key: stores.maps.get(key) is not None)
    publisher = Publisher(stores, ADAPTERS["json"].engine("json", JsonOptions(json_path=tmp_path / "out.json")),
                          LoopOptions(region="eu", resync=0.5), status_sink=sink)
    source = KubeSource(client, stores, publisher, WatchOptions(backoff_initial=0.05, silence_timeout=5), clock=publisher.clock)
    task = asyncio.create_task(loop.run(publisher, source, kube=client))
    try:
        await eventually(lambda: stored(kube_api).get(("prod", "chat"), {}).get("status") == "True")
        (report,) = kube_api.objects(RR)
        report["maps"]["chat"]["status"] = "False"
        kube_api.update(report)
        await eventually(lambda: stored(kube_api)[("prod", "chat")]["status"] == "True")
        kube_api.delete(RR, "prod", report["metadata"]["name"])
        await eventually(lambda: stored(kube_api).get(("prod", "chat"), {}).get("status") == "True")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()
