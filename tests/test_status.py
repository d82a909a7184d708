from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from publisher.kube import Kube
from publisher import loop
from publisher.loop import LoopOptions, Publisher
from publisher.core.model import Condition, parse_traffic_map, validate
from publisher.core.values import MapKey, Reason
from publisher.source.informer import WatchOptions
from publisher.source.kube_source import KubeSource
from publisher.source.objects import parse_isvc
from publisher.source.store import Stores
from publisher.status import ConditionSink, Verdict, caught_up, condition_for, condition_type, field_manager
from tests.loop_turns import loop_turns
from tests.builders import make_condition, make_entry, make_map
from tests.fakes.kube_api import FakeKubeAPI
from tests.fakes.memory_adapter import memory_engine
from tests.test_kube_integration import ISVC, TM, ours, seed

FIELD_MANAGER = "ome-gateway-publisher-eu"

NOW = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


def existing(**fields) -> Condition:
    base = {"type": "gateway-publisher.ome.io/eu", "status": "True", "reason": "Published", "message": "m",
            "observedGeneration": 3, "lastTransitionTime": "2026-01-01T00:00:00Z"}
    return validate(Condition, base | fields)


def test_names_follow_the_instance():
    assert condition_type("eu") == "gateway-publisher.ome.io/eu"
    assert field_manager("eu") == "ome-gateway-publisher-eu"


def test_new_condition_is_complete_and_valid():
    condition = condition_for(Verdict(True, Reason.PUBLISHED, "m", 3), "eu", None, NOW)
    assert condition == {"type": "gateway-publisher.ome.io/eu", "status": "True", "reason": "Published", "message": "m",
                         "observedGeneration": 3, "lastTransitionTime": "2026-11-30T12:00:00Z"}
    assert RFC3339.match(condition["lastTransitionTime"])


def test_same_condition_is_not_written_again():
    assert condition_for(Verdict(True, Reason.PUBLISHED, "m", 3), "eu", existing(), NOW) is None


@pytest.mark.parametrize(
    ("report", "moves"),
    [
        (Verdict(True, Reason.PUBLISHED, "other message", 3), False),
        (Verdict(True, Reason.PUBLISHED, "m", 4), False),
        (Verdict(False, Reason.VERIFICATION_FAILED, "m", 3), True),
    ],
    ids=["message", "generation", "status"],
)
def test_transition_time_moves_only_with_status(report, moves):
    condition = condition_for(report, "eu", existing(), NOW)
    assert condition is not None
    assert (condition["lastTransitionTime"] == "2026-11-30T12:00:00Z") == moves


# --- issue 20: the condition sink against the fake API server -----------------------------------


def cache(stores: Stores, api: FakeKubeAPI, name: str = "chat") -> MapKey:
    """What the watch cache holds of the map and its InferenceService: the server's objects now."""
    raw, isvc = api.get(TM, "prod", name), api.get(ISVC, "prod", name)
    item = parse_traffic_map(raw)
    stores.maps.upsert(item.key, item, raw["metadata"]["resourceVersion"])
    stores.isvcs.upsert(item.key, parse_isvc(isvc), isvc["metadata"]["resourceVersion"])
    return item.key


async def decide_and_report(publisher: Publisher, keys: list[MapKey]) -> None:
    """One pass over `keys`, as an event for each would give, and the status writes it queues."""
    publisher.changed(keys, at=0.0)
    await publisher.sync_once(publisher.queue.take_ready())
    await publisher.outbox.write(publisher.outbox.due.take_ready())


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@contextlib.asynccontextmanager
async def driven(kubeconfig: Path, instance: str = "eu", clock: FakeClock | None = None) -> AsyncIterator[tuple[Publisher, Stores]]:
    """A publisher with the condition sink, driven pass by pass by the test (no source, no tasks)."""
    kube = await Kube.connect(kubeconfig)
    try:
        stores = Stores.empty()
        engine, _ = memory_engine()
        sink = ConditionSink(kube, stores.maps, instance)
        publisher = Publisher(stores, engine, LoopOptions(adapter_name=engine.name, region=instance), status_sink=sink,
                              clock=clock or FakeClock())
        await publisher.start()
        publisher.synced()
        yield publisher, stores
    finally:
        await kube.close()


async def test_a_cache_lagging_our_own_write_is_not_written_from_again(kube_api, kubeconfig):
    # Issue 20, finding 1: re-decided before the watch delivered our write, the map looked as if it
    # had no condition of ours, and it was written again (with a new lastTransitionTime, a change
    # and an event for every other region).
    seed(kube_api)
    async with driven(kubeconfig) as (publisher, stores):
        key = cache(stores, kube_api)
        await decide_and_report(publisher, [key])
        assert ours(kube_api)["reason"] == "Published"
        # Another region's event makes us decide again; the cache does not have our write yet.
        await decide_and_report(publisher, [key])
        assert kube_api.count("patch", field_manager=FIELD_MANAGER) == 1
        # The watch catches up; a decision from then on compares with what the cache holds.
        cache(stores, kube_api)
        await decide_and_report(publisher, [key])
        assert kube_api.count("patch", field_manager=FIELD_MANAGER) == 1


def ome_writes_entries(api: FakeKubeAPI, name: str = "chat") -> None:
    """OME's first write of a change: worker-b scales to 4 replicas, new weights, the generation
    moves; its Routable condition still speaks of the generation before."""
    current = api.get(TM, "prod", name)
    current["spec"]["entries"] = [make_entry("worker-a", allocated=4, ready=4, weight=1),
                                  make_entry("worker-b", allocated=4, ready=4, factor="3", weight=3)]
    api.update(current)


def ome_writes_routable(api: FakeKubeAPI, name: str = "chat") -> None:
    """OME's second write: the Routable condition for the map's generation now."""
    current = api.get(TM, "prod", name)
    routable = make_condition("Routable", observed_generation=current["metadata"]["generation"])
    current["status"]["conditions"] = [c for c in current["status"]["conditions"] if c["type"] != "Routable"] + [routable]
    api.update(current)


async def held_by_omes_first_write(publisher, stores, kube_api) -> MapKey:
    """The map published, then OME's first write of a change (its entries) decided: it waits for
    OME's second, published still, and held RoutableOutdated if that does not come."""
    key = cache(stores, kube_api)
    await decide_and_report(publisher, [key])
    ome_writes_entries(kube_api)
    cache(stores, kube_api)
    await decide_and_report(publisher, [key])
    return key


async def test_a_hold_between_omes_two_writes_is_not_written(kube_api, kubeconfig):
    # Issue 20, finding 2: deciding between OME's two writes holds the map RoutableOutdated for a
    # few milliseconds; its False and the True after it were half the status writes.
    seed(kube_api)
    clock = FakeClock()
    async with driven(kubeconfig, clock=clock) as (publisher, stores):
        key = await held_by_omes_first_write(publisher, stores, kube_api)
        assert publisher.states[key].state == "published"  # as the gateway serves it still
        clock.now += 0.01
        ome_writes_routable(kube_api)
        cache(stores, kube_api)
        await decide_and_report(publisher, [key])  # published, generation 2: written at once
        assert ours(kube_api)["observedGeneration"] == 2
        clock.now += 1
        await publisher.outbox.write(publisher.outbox.due.take_ready())
    assert kube_api.count("patch", field_manager=FIELD_MANAGER) == 2
    assert ours(kube_api)["status"] == "True"


async def test_a_hold_that_stands_is_written_after_the_delay_with_its_latest_verdict(kube_api, kubeconfig):
    seed(kube_api)
    clock = FakeClock()
    async with driven(kubeconfig, clock=clock) as (publisher, stores):
        key = await held_by_omes_first_write(publisher, stores, kube_api)
        assert ours(kube_api)["status"] == "True"
        clock.now += 0.3
        await decide_and_report(publisher, [key])  # decided again while held: the delay runs from the first
        assert publisher.queue.take_ready() == {}
        clock.now += 0.2
        # The hold has stood the delay: the map falls due, is held, and its condition written at once.
        await publisher.sync_once(publisher.queue.take_ready())
        assert publisher.states[key].reason == "RoutableOutdated"
        await publisher.outbox.write(publisher.outbox.due.take_ready())
        condition = ours(kube_api)
        assert (condition["status"], condition["reason"]) == ("False", "RoutableOutdated")
        assert publisher.adapter.confirmed[key] is not None  # the gateway keeps generation 1 meanwhile
    assert kube_api.count("patch", field_manager=FIELD_MANAGER) == 2


async def test_an_invalid_maps_condition_is_read_back_not_written_on_every_pass(kube_api, kubeconfig):
    seed(kube_api)
    clock = FakeClock()
    async with driven(kubeconfig, clock=clock) as (publisher, stores):
        key = cache(stores, kube_api)
        await decide_and_report(publisher, [key])
        invalid = kube_api.get(TM, "prod", "chat")
        invalid["spec"]["entries"][0]["weight"] = -1
        kube_api.update(invalid)
        cache(stores, kube_api)
        await decide_and_report(publisher, [key])
        clock.now += 1
        await publisher.outbox.write(publisher.outbox.due.take_ready())
        assert ours(kube_api)["reason"] == "InvalidMap"
        cache(stores, kube_api)  # the watch delivers our write
        await decide_and_report(publisher, [key])
    assert kube_api.count("patch", field_manager=FIELD_MANAGER) == 2


async def test_once_writes_a_hold_without_waiting_for_the_delay(kube_api, kubeconfig):
    seed(kube_api, routable=False)
    kube = await Kube.connect(kubeconfig)
    try:
        stores = Stores.empty()
        engine, _ = memory_engine()
        publisher = Publisher(stores, engine, LoopOptions(adapter_name=engine.name, region="eu", status_delay=3600),
                              status_sink=ConditionSink(kube, stores.maps, "eu"))
        await loop.once(publisher, KubeSource(kube, stores, publisher, WatchOptions(region="eu"), clock=publisher.clock), timeout=30)
    finally:
        await kube.close()
    assert (ours(kube_api)["status"], ours(kube_api)["reason"]) == ("False", "RoutableOutdated")


@pytest.mark.parametrize(("seen", "written", "expected"), [("41", "42", False), ("42", "42", True), ("100", "42", True),
                                                          ("", "42", False), ("abc", "abc", True), ("abd", "abc", False)])
def test_the_cache_has_caught_up_with_a_write_at_its_version_or_a_newer_one(seen, written, expected):
    assert caught_up(seen, written) is expected


async def test_a_verdict_about_a_deleted_map_is_not_written_on_the_one_made_again(kube_api, kubeconfig):
    # Found by the status simulation (a leader change after a map was deleted and made again under
    # its name): the new leader wrote the verdict it held about the deleted map onto the new one.
    seed(kube_api)
    kube = await Kube.connect(kubeconfig)
    try:
        stores = Stores.empty()
        deleted_uid = kube_api.get(TM, "prod", "chat")["metadata"]["uid"]
        kube_api.delete(TM, "prod", "chat")
        kube_api.create(make_map("chat", generation=1, isvc_uid=kube_api.get(ISVC, "prod", "chat")["metadata"]["uid"]))
        key = cache(stores, kube_api)
        sink = ConditionSink(kube, stores.maps, "eu")
        assert await sink.write({key: Verdict(True, Reason.PUBLISHED, "served", 1, deleted_uid)}) == {}
        assert ours(kube_api) == {}
        # A verdict about the map that is there now is written.
        made_again = Verdict(True, Reason.PUBLISHED, "served", 1, kube_api.get(TM, "prod", "chat")["metadata"]["uid"])
        assert await sink.write({key: made_again}) == {}
        assert ours(kube_api)["reason"] == "Published"
    finally:
        await kube.close()


class CountingKube:
    """Answers every status apply at once, and counts the tasks alive while one is in flight."""

    def __init__(self) -> None:
        self.applied = 0
        self.most_tasks = 0

    async def apply(self, resource, body, **kwargs):  # noqa: ANN001, ANN003 - Kube.apply's shape
        import asyncio

        self.most_tasks = max(self.most_tasks, len(asyncio.all_tasks()))
        await asyncio.sleep(0)
        self.applied += 1
        return {"metadata": {"resourceVersion": str(1000 + self.applied)}}


async def test_a_batch_of_many_verdicts_runs_few_tasks_and_gives_the_event_loop_back():
    # Issue 29: a batch made one task per verdict; at start (a condition for each of 10,000
    # maps) and at each resync's recheck (10,000 verdicts, nearly all unchanged) every task
    # compared its verdict in one turn of the event loop: 200 ms that gateway writes waited.
    stores = Stores.empty()
    keys = []
    for i in range(5000):
        tm = parse_traffic_map(make_map(name=f"m{i}"))
        stores.maps.upsert(tm.key, tm, "1")
        keys.append(tm.key)
    kube = CountingKube()
    sink = ConditionSink(kube, stores.maps, "eu", concurrency=8)  # type: ignore[arg-type]
    verdict = Verdict(True, Reason.PUBLISHED, "published to memory", 1)
    async with loop_turns() as turns:
        assert await sink.write({key: verdict for key in keys}) == {}
        assert kube.applied == 5000
        assert kube.most_tasks <= 8 + 2, f"{kube.most_tasks} tasks for 8 concurrent writes"
        turns(reset=True)
        assert await sink.write({key: verdict for key in keys}) == {}  # a recheck: nothing changed
        assert kube.applied == 5000
        assert turns() >= 10, f"comparing 5,000 verdicts let other tasks run {turns()} times"
