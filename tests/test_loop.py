from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Awaitable, Callable

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from adapters.base import Unavailable
from publisher import loop, metrics
from publisher.loop import KeyQueue, LoopOptions, Publisher
from publisher.loop.options import RESYNC_REST_CAP
from publisher.retry import Backoff
from publisher.core.model import parse_traffic_map
from publisher.core.values import MapKey, Reason
from publisher.source.objects import parse_isvc
from publisher.source.store import Stores
from tests.loop_turns import loop_turns
from tests.builders import make_condition, make_entry, make_isvc, make_map
from tests.fakes.memory_adapter import MemoryGateway, memory_engine
from tests.gateways import eventually

CHAT = MapKey("prod", "chat")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def put_map(stores: Stores, raw: dict, *, isvc: dict | None = None) -> MapKey:
    tm = parse_traffic_map(raw)
    stores.maps.upsert(tm.key, tm, raw["metadata"]["resourceVersion"])
    isvc_raw = isvc if isvc is not None else make_isvc(raw["metadata"]["name"], raw["metadata"]["namespace"])
    stores.isvcs.upsert(tm.key, parse_isvc(isvc_raw), isvc_raw["metadata"]["resourceVersion"])
    return tm.key


def make_publisher(gateway: MemoryGateway | None = None, **options) -> tuple[Publisher, Stores, MemoryGateway]:
    stores = Stores.empty()
    engine, gateway = memory_engine(gateway)
    return Publisher(stores, engine, LoopOptions(adapter_name=engine.name, **options)), stores, gateway


class OneMapSource:
    """A source that lists the chat map, gives its first full view and then watches forever;
    `before`, when given, runs first (the list in progress)."""

    def __init__(self, publisher: Publisher, stores: Stores, before: Callable[[], Awaitable[None]] | None = None) -> None:
        self.publisher, self.stores, self.before = publisher, stores, before

    async def run(self) -> None:
        if self.before is not None:
            await self.before()
        put_map(self.stores, make_map())
        self.publisher.changed([CHAT], at=0.0)
        self.publisher.synced()
        await asyncio.Event().wait()

    def problem(self) -> None:
        return None


def weights(adapter: MemoryGateway, key: MapKey) -> list[int]:
    return [b.weight for b in adapter.held[key].backends]


# --- KeyQueue and Backoff -------------------------------------------------------------------------


def test_queue_dedups_and_keeps_earliest_event_time():
    queue = KeyQueue(FakeClock())
    queue.add(CHAT, 1.0)
    queue.add(CHAT, 2.0)
    queue.add(MapKey("prod", "embed"))
    assert queue.take_ready() == {CHAT: 1.0, MapKey("prod", "embed"): None}
    assert queue.take_ready() == {}


def test_queue_key_added_while_processing_comes_back_once():
    queue = KeyQueue(FakeClock())
    queue.add(CHAT)
    taken = queue.take_ready()
    queue.add(CHAT)
    queue.add(CHAT)
    assert list(taken) == [CHAT]
    assert list(queue.take_ready()) == [CHAT]


def test_queue_delayed_key_waits_for_its_time():
    clock = FakeClock()
    queue = KeyQueue(clock)
    queue.add_after(CHAT, 5.0)
    assert queue.take_ready() == {}
    clock.now += 5.0
    assert list(queue.take_ready()) == [CHAT]


class ParkedKeys(RuleBasedStateMachine):
    """KeyQueue's parked keys against a model: a key parked and not cancelled since comes back
    once its delay has passed, a cancelled one does not, and the queue keeps no record of a key
    it no longer holds parked."""

    keys = (CHAT, MapKey("prod", "embed"), MapKey("dev", "chat"))

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.queue = KeyQueue(self.clock)
        self.parked: list[tuple[float, MapKey]] = []  # the model: what is due when, not cancelled

    @rule(key=st.sampled_from(keys), delay=st.sampled_from([0.0, 0.5, 1.0, 5.0]))
    def park(self, key: MapKey, delay: float) -> None:
        self.queue.add_after(key, delay)
        self.parked.append((self.clock.now + delay, key))

    @rule(key=st.sampled_from(keys))
    def cancel(self, key: MapKey) -> None:
        self.queue.cancel_after(key)
        self.parked = [(due, parked) for due, parked in self.parked if parked != key]

    @rule(seconds=st.sampled_from([0.0, 0.25, 0.5, 1.0, 5.0]))
    def take(self, seconds: float) -> None:
        self.clock.now += seconds
        due = {key for at, key in self.parked if at <= self.clock.now}
        self.parked = [(at, key) for at, key in self.parked if at > self.clock.now]
        assert set(self.queue.take_ready()) == due

    @invariant()
    def records_only_parked_keys(self) -> None:
        held = {key for _, _, key in self.queue._delayed}
        assert set(self.queue._parked) == held
        assert set(self.queue._cancelled) <= held
        assert sum(self.queue._parked.values()) == len(self.queue._delayed)


TestParkedKeys = ParkedKeys.TestCase


async def test_queue_take_waits_for_an_add():
    queue = KeyQueue()
    waiter = asyncio.create_task(queue.take())
    await asyncio.sleep(0)
    assert not waiter.done()
    queue.add(CHAT)
    assert await asyncio.wait_for(waiter, 5) == {CHAT: None}


def test_backoff_doubles_caps_and_forgets():
    backoff = Backoff(base=0.5, cap=3.0)
    assert [backoff.delay(CHAT) for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    backoff.forget(CHAT)
    assert backoff.delay(CHAT) == 0.5


# --- Publisher ------------------------------------------------------------------------------------


async def test_publishes_a_verified_map():
    publisher, stores, adapter = make_publisher()
    put_map(stores, make_map())
    await publisher.start()
    publisher.synced()
    await publisher.sync_once(publisher.queue.take_ready())
    pub = adapter.held[CHAT]
    assert [(b.cluster, b.weight) for b in pub.backends] == [("worker-a", 2), ("worker-b", 3)]
    assert pub.hostname == "chat.example.com"
    assert publisher.states[CHAT].state == "published"


async def test_held_map_keeps_its_publication_while_others_move():
    publisher, stores, adapter = make_publisher()
    put_map(stores, make_map())
    embed = put_map(stores, make_map("embed"), isvc=make_isvc("embed"))
    await publisher.start()
    publisher.synced()
    await publisher.sync_once(publisher.queue.take_ready())
    before = adapter.held[CHAT]
    # chat now claims weights that do not match its replicas; embed scales worker-b down.
    put_map(stores, make_map(resource_version="2", generation=4,
                             entries=[make_entry("worker-a", allocated=4, ready=4, weight=1),
                                      make_entry("worker-b", allocated=2, ready=2, factor="3", weight=1)]))
    put_map(stores, make_map("embed", resource_version="2", generation=4,
                             entries=[make_entry("worker-a", allocated=4, ready=4, weight=1),
                                      make_entry("worker-b", allocated=0, ready=0, weight=0, healthy=False)]),
            isvc=make_isvc("embed"))
    publisher.changed([CHAT, embed], at=0.0)
    await publisher.sync_once(publisher.queue.take_ready())
    assert adapter.held[CHAT] == before
    assert publisher.states[CHAT].reason == Reason.VERIFICATION_FAILED
    assert weights(adapter, embed) == [1, 0]
    assert publisher.outbox.verdicts == {}  # no kube: nothing to report to


async def test_nothing_is_withdrawn_before_the_first_sync():
    adapter = MemoryGateway()
    publisher, stores, _ = make_publisher(adapter)
    put_map(stores, make_map())
    await publisher.start()
    publisher.synced()
    await publisher.sync_once(publisher.queue.take_ready())
    # A restart: the gateway holds chat, the new source has not listed yet.
    restarted, stores2, _ = make_publisher(adapter)
    await restarted.start()
    applier = asyncio.create_task(restarted.run_applier())
    restarted.changed([CHAT], at=0.0)
    await asyncio.sleep(0.05)
    assert CHAT in adapter.held and len(adapter.applies) == 1
    put_map(stores2, make_map())
    restarted.synced()
    await asyncio.sleep(0.05)
    applier.cancel()
    await asyncio.gather(applier, return_exceptions=True)
    # Same map, same weights: the restarted loop wrote nothing.
    assert len(adapter.applies) == 1


async def test_deleted_map_and_opted_out_isvc_are_withdrawn():
    publisher, stores, adapter = make_publisher()
    put_map(stores, make_map())
    embed = put_map(stores, make_map("embed"), isvc=make_isvc("embed"))
    await publisher.start()
    publisher.synced()
    await publisher.sync_once(publisher.queue.take_ready())
    stores.maps.delete(CHAT)
    stores.isvcs.upsert(embed, parse_isvc(make_isvc("embed", enabled=False)), "2")
    publisher.changed([CHAT, embed], at=0.0)
    await publisher.sync_once(publisher.queue.take_ready())
    assert adapter.held == {}
    assert publisher.states[embed].state == "withdrawn"
    # The deleted map leaves every record; the opted-out one stays visible as withdrawn.
    assert CHAT not in publisher.states
    assert [m["name"] for m in publisher.debug_maps()] == ["embed"]


async def test_failed_apply_backs_off_and_retries():
    clock = FakeClock()
    adapter = MemoryGateway(fail_with=[Unavailable("gateway down")])
    stores = Stores.empty()
    publisher = Publisher(stores, memory_engine(adapter)[0], LoopOptions(backoff_base=1.0), clock=clock)
    put_map(stores, make_map())
    await publisher.start()
    publisher.synced()
    await publisher.sync_once(publisher.queue.take_ready())
    assert CHAT not in adapter.held
    assert publisher.states[CHAT].reason == Reason.APPLY_FAILED
    assert publisher.queue.take_ready() == {}
    clock.now += 1.0
    await publisher.sync_once(publisher.queue.take_ready())
    assert weights(adapter, CHAT) == [2, 3]
    assert publisher.states[CHAT].state == "published"


async def test_rejected_map_is_isolated():
    adapter = MemoryGateway(reject={CHAT: "gateway refused it"})
    publisher, stores, _ = make_publisher(adapter)
    put_map(stores, make_map())
    embed = put_map(stores, make_map("embed"), isvc=make_isvc("embed"))
    await publisher.start()
    publisher.synced()
    await publisher.sync_once(publisher.queue.take_ready())
    assert set(adapter.held) == {embed}
    assert publisher.states[CHAT].state == "failed"
    assert CHAT not in publisher.published


async def test_map_the_adapter_cannot_express_is_held_as_invalid_plan():
    adapter = MemoryGateway(cannot_express={CHAT: "too many backends"})
    publisher, stores, _ = make_publisher(adapter)
    put_map(stores, make_map())
    await publisher.start()
    publisher.synced()
    await publisher.sync_once(publisher.queue.take_ready())
    assert adapter.held == {}
    assert publisher.states[CHAT].reason == Reason.INVALID_PLAN


async def test_burst_on_one_map_costs_one_write_per_apply_and_ends_in_the_last_state():
    adapter = MemoryGateway(apply_delay=0.01)
    publisher, stores, _ = make_publisher(adapter)
    put_map(stores, make_map())
    await publisher.start()
    publisher.synced()
    applier = asyncio.create_task(publisher.run_applier())
    for ready in range(1, 101):
        put_map(stores, make_map(resource_version=str(ready + 1),
                                 entries=[make_entry("worker-a", allocated=ready, ready=ready, weight=1)]))
        publisher.changed([CHAT], at=0.0)
        if ready % 10 == 0:
            await asyncio.sleep(0)
    await loop_idle(publisher)
    applier.cancel()
    await asyncio.gather(applier, return_exceptions=True)
    assert [b.endpoint for b in adapter.held[CHAT].backends] == ["http://chat.prod.worker-a.example.com"]
    assert len(adapter.applies) < 100


async def loop_idle(publisher: Publisher) -> None:
    for _ in range(200):
        await asyncio.sleep(0.01)
        if not len(publisher.queue):
            await asyncio.sleep(0.05)
            if not len(publisher.queue):
                return
    raise AssertionError("loop never went idle")


async def test_resync_repairs_drift():
    adapter = MemoryGateway()
    stores = Stores.empty()
    publisher = Publisher(stores, memory_engine(adapter)[0], LoopOptions(resync=0.05))
    put_map(stores, make_map())
    await publisher.start()
    publisher.synced()
    await publisher.sync_once(publisher.queue.take_ready())
    adapter.held.clear()  # someone emptied the gateway behind our back
    resync = asyncio.create_task(publisher.run_resync())
    applier = asyncio.create_task(publisher.run_applier())
    for _ in range(200):
        await asyncio.sleep(0.01)
        if CHAT in adapter.held:
            break
    for task in (resync, applier):
        task.cancel()
    await asyncio.gather(resync, applier, return_exceptions=True)
    assert weights(adapter, CHAT) == [2, 3]


def test_ready_needs_start_sync_and_a_recent_success():
    clock = FakeClock()
    publisher = Publisher(Stores.empty(), memory_engine()[0], LoopOptions(resync=10), clock=clock)
    assert publisher.ready()[0] is False
    publisher.started = True
    publisher.is_synced = True
    assert publisher.ready() == (False, "no successful sync yet")
    publisher.gateway.last_success = clock.now
    assert publisher.ready() == (True, "ready")
    clock.now += 31
    assert publisher.ready()[0] is False


@pytest.mark.parametrize("leader", [None])
async def test_once_publishes_from_a_source(leader):
    publisher, stores, adapter = make_publisher()
    await loop.once(publisher, OneMapSource(publisher, stores))
    assert weights(adapter, CHAT) == [2, 3]


async def test_held_map_is_logged_once_per_reason(caplog):
    publisher, stores, _ = make_publisher()
    put_map(stores, make_map(entries=[make_entry("worker-a", allocated=4, ready=4, weight=7)]))
    await publisher.start()
    publisher.synced()
    with caplog.at_level("WARNING", logger="publisher.loop"):
        for version in ("2", "3"):
            put_map(stores, make_map(resource_version=version, entries=[make_entry("worker-a", allocated=4, ready=4, weight=7)]))
            publisher.changed([CHAT], at=0.0)
            await publisher.sync_once(publisher.queue.take_ready())
        put_map(stores, make_map(resource_version="4", routable=False))
        publisher.changed([CHAT], at=0.0)
        await publisher.sync_once(publisher.queue.take_ready())
    held = [r for r in caplog.records if r.getMessage() == "map held"]
    assert [r.reason for r in held] == ["VerificationFailed", "RoutableOutdated"]


class VerdictsSink:
    """Takes every verdict it is handed (the outbox's `verdicts` are what this test reads)."""

    def stale(self) -> None:
        pass

    async def write(self, verdicts):
        return {}


async def test_a_published_map_between_omes_two_writes_stays_published_until_the_hold_stands_the_status_delay(caplog):
    # Issue 29: each change of every map was settled twice, published -> held RoutableOutdated ->
    # published, for the milliseconds between OME's entries and its Routable for them: a state
    # change, a held verdict the status writer looked at again half a second later, a map_held
    # series made and dropped and a log line, ten times a second at 10 changes/s.
    clock = FakeClock()
    stores = Stores.empty()
    publisher = Publisher(stores, memory_engine()[0], LoopOptions(adapter_name="memory", status_delay=0.5),
                          status_sink=VerdictsSink(), clock=clock)  # type: ignore[arg-type]
    put_map(stores, make_map(generation=3))
    await publisher.start()
    publisher.synced()
    await publisher.sync_once(publisher.queue.take_ready())
    assert publisher.states.state(CHAT).state == "published"
    held_series = {"namespace": "prod", "name": "chat", "reason": "RoutableOutdated"}

    async def ome_writes(generation: int, *, routable: bool) -> None:
        observed = generation if routable else generation - 1
        put_map(stores, make_map(generation=generation, resource_version=f"{generation}{int(routable)}",
                                 routable=make_condition("Routable", observed_generation=observed)))
        publisher.changed([CHAT], at=clock.now)
        await publisher.sync_once(publisher.queue.take_ready())

    with caplog.at_level("INFO", logger="publisher.loop"):
        await ome_writes(4, routable=False)
        assert publisher.states.state(CHAT).state == "published"
        assert publisher.outbox.verdicts[CHAT].published and publisher.outbox.verdicts[CHAT].generation == 3
        assert metrics.REGISTRY.get_sample_value("ome_gateway_publisher_map_held", held_series) is None
        clock.now += 0.01
        await ome_writes(4, routable=True)
        assert publisher.outbox.verdicts[CHAT].generation == 4
        # What the first write parked the map for is dropped: no pass comes of it.
        clock.now += 1.0
        assert publisher.queue.take_ready() == {}
        # OME's second write does not come: once the hold has stood the delay, it is one.
        await ome_writes(5, routable=False)
        clock.now += 0.3
        assert publisher.queue.take_ready() == {}
        assert publisher.states.state(CHAT).state == "published"
        clock.now += 0.2
        await publisher.sync_once(publisher.queue.take_ready())
        assert publisher.states.state(CHAT).state == "held"
        assert metrics.REGISTRY.get_sample_value("ome_gateway_publisher_map_held", held_series) == 1
        # Its condition is due at once: the hold has stood the delay already.
        assert not publisher.outbox.verdicts[CHAT].published
        assert CHAT in publisher.outbox.due.take_ready()
        # A map never published waits on Routable at once.
        other = MapKey("prod", "other")
        put_map(stores, make_map(name="other", generation=2, routable=make_condition("Routable", observed_generation=1)))
        publisher.changed([other], at=clock.now)
        await publisher.sync_once(publisher.queue.take_ready())
        assert publisher.states.state(other).state == "held"
    held = [(r.map, r.reason, r.levelname) for r in caplog.records if r.getMessage() == "map held"]
    assert held == [(str(CHAT), "RoutableOutdated", "WARNING"), (str(other), "RoutableOutdated", "WARNING")]


def test_published_message_names_the_weights_and_what_an_all_zero_map_gets():
    from publisher.loop.settle import published_message
    from publisher.core.values import Backend, Publication

    zero = Publication("prod", "chat", "chat.example.com", 4, 6, (Backend("worker-a", "http://a", 0),))
    assert published_message("envoy", zero, None, None) == (
        "the envoy gateway serves generation 4 for chat.example.com: worker-a=0; every weight is 0, so the gateway answers 503"
    )
    assert "503" not in published_message("httproute", zero, "Gateway API answers it with HTTP 500", None)


# --- issue 11: regressions ------------------------------------------------------------------------


async def test_resync_runs_between_writes_and_never_adopts_a_stale_read(caplog):
    """Finding 1: resync read the gateway during an apply and adopted the stale read, taking a held
    map's live weights back and warning of drift that was not there."""
    gateway = MemoryGateway(apply_delay=0.03)
    publisher, stores, _ = make_publisher(gateway, resync=0.02)
    put_map(stores, make_map())
    embed = put_map(stores, make_map("embed"), isvc=make_isvc("embed"))
    await publisher.start()
    publisher.synced()
    tasks = [asyncio.create_task(publisher.run_applier()), asyncio.create_task(publisher.run_resync())]
    with caplog.at_level("WARNING", logger="publisher.loop"):
        for ready in range(2, 12):
            put_map(stores, make_map("embed", resource_version=str(ready), generation=3,
                                     entries=[make_entry("worker-a", allocated=ready, ready=ready, weight=ready, service="embed"),
                                              make_entry("worker-b", weight=1, service="embed")]),
                    isvc=make_isvc("embed"))
            publisher.changed([embed], at=0.0)
            await asyncio.sleep(0.02)
        for _ in range(300):
            if embed in gateway.held and weights(gateway, embed) == [11, 1]:
                break
            await asyncio.sleep(0.01)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert gateway.reads >= 3, "resync never ran"
    assert not [r for r in caplog.records if r.getMessage() == "gateway drift repaired"]
    assert weights(gateway, CHAT) == [2, 3]


async def test_a_generation_only_change_writes_nothing_and_reports_the_new_generation():
    """Finding 3: a spec change that leaves the weights alone rewrote the gateway."""
    publisher, stores, gateway = make_publisher()
    put_map(stores, make_map(generation=3))
    await publisher.start()
    publisher.synced()
    await publisher.sync_once(publisher.queue.take_ready())
    assert len(gateway.applies) == 1
    put_map(stores, make_map(generation=4, resource_version="2"))
    publisher.changed([CHAT], at=0.0)
    await publisher.sync_once(publisher.queue.take_ready())
    assert len(gateway.applies) == 1
    assert publisher.provenance[CHAT].generation == 4
    assert publisher.debug_maps()[0]["publishedGeneration"] == 4


async def test_two_maps_with_one_hostname_hold_the_younger_with_host_conflict():
    """Finding 4: both maps reported Published and one was never served."""
    publisher, stores, gateway = make_publisher()
    put_map(stores, make_map(metadata={"creationTimestamp": "2026-01-01T00:00:00Z"}))
    copy = put_map(stores, make_map("chat-copy", metadata={"creationTimestamp": "2026-05-01T00:00:00Z"}),
                   isvc=make_isvc("chat-copy", host="chat.example.com"))
    await publisher.start()
    publisher.synced()
    await publisher.sync_once(publisher.queue.take_ready())
    assert set(gateway.held) == {CHAT}
    assert publisher.states[copy].state == "held" and publisher.states[copy].reason == Reason.HOST_CONFLICT
    # The owner is deleted: the waiting map is released and published in the next pass.
    stores.maps.delete(CHAT)
    publisher.changed([CHAT], at=0.0)
    await publisher.sync_once(publisher.queue.take_ready())
    await publisher.sync_once(publisher.queue.take_ready())
    assert set(gateway.held) == {copy}
    assert publisher.states[copy].state == "published"


async def test_a_hostname_swap_in_two_steps_is_published_on_its_events_without_a_resync():
    """Issue 27, item 15: B moved onto A's hostname (held), then A onto B's old one; nothing
    decided B again when A's move waited on it, so both stayed HostConflict until the next resync."""
    publisher, stores, gateway = make_publisher()

    def put(name: str, host: str, version: str) -> MapKey:
        created = {"a": "2026-01-01T00:00:00Z", "b": "2026-02-01T00:00:00Z"}[name]
        key = put_map(stores, make_map(name, resource_version=version, metadata={"creationTimestamp": created}),
                      isvc=make_isvc(name, host=host, resource_version=version))
        publisher.changed([key], at=0.0)
        return key

    a, b = put("a", "a.example.com", "1"), put("b", "b.example.com", "1")
    await publisher.start()
    publisher.synced()
    await publisher.sync_once(publisher.queue.take_ready())
    put("b", "a.example.com", "2")
    await publisher.sync_once(publisher.queue.take_ready())
    assert publisher.states[b].reason == Reason.HOST_CONFLICT
    put("a", "b.example.com", "2")
    # The events alone, no resync: every pass the queue asks for, and a bounded number.
    for _ in range(5):
        await publisher.sync_once(publisher.queue.take_ready())
    assert {key: route.hostname for key, route in gateway.held.items()} == {a: "b.example.com", b: "a.example.com"}
    assert publisher.states[a].state == publisher.states[b].state == "published"


async def test_an_error_deciding_one_map_holds_it_and_the_others_publish():
    """Finding 9: a probe time without a zone plus --probe-max-age raised out of sync_once."""
    publisher, stores, gateway = make_publisher(probe_max_age=60.0)
    naive = make_entry("worker-a", allocated=1, ready=1, weight=1,
                       probe={"result": "Passing", "gated": False, "lastProbeTime": "2026-01-01T00:00:00"})
    put_map(stores, make_map(entries=[naive]))
    embed = put_map(stores, make_map("embed"), isvc=make_isvc("embed"))
    await publisher.start()
    publisher.synced()
    await publisher.sync_once(publisher.queue.take_ready())
    assert embed in gateway.held
    assert publisher.states[embed].state == "published"
    assert publisher.states[CHAT].reason == Reason.INTERNAL_ERROR
    # The exception's type and message, not its repr (issue 23, point 7).
    assert re.fullmatch(r"[a-z ]+ this map raised [A-Za-z]+Error: [^()]+", publisher.states[CHAT].message), publisher.states[CHAT].message


async def test_a_map_read_back_that_todays_check_refuses_is_kept():
    """Finding 10: after a restart with other options, an unrelated write withdrew such a map."""
    gateway = MemoryGateway()
    first, stores, _ = make_publisher(gateway)
    put_map(stores, make_map())
    await first.start()
    first.synced()
    await first.sync_once(first.queue.take_ready())
    gateway.cannot_express[CHAT] = "this gateway no longer takes it"
    restarted, stores2, _ = make_publisher(gateway)
    put_map(stores2, make_map())
    embed = put_map(stores2, make_map("embed"), isvc=make_isvc("embed"))
    await restarted.start()
    restarted.synced()
    await restarted.sync_once(restarted.queue.take_ready())
    assert restarted.states[CHAT].reason == Reason.INVALID_PLAN
    assert set(gateway.held) == {CHAT, embed}


async def test_a_held_map_deleted_during_an_apply_leaves_no_held_series():
    """Finding 10: the map_held gauge leaked when a held map was deleted during an apply."""
    from publisher import metrics

    publisher, stores, gateway = make_publisher()
    put_map(stores, make_map(entries=[make_entry("worker-a", allocated=4, ready=4, weight=7)]))
    await publisher.start()
    publisher.synced()
    await publisher.sync_once(publisher.queue.take_ready())
    held = metrics.REGISTRY.get_sample_value(metrics.PREFIX + "map_held", {"namespace": "prod", "name": "chat", "reason": "VerificationFailed"})
    assert held == 1
    stores.maps.delete(CHAT)
    publisher.changed([CHAT], at=0.0)
    await publisher.sync_once(publisher.queue.take_ready())
    assert metrics.REGISTRY.get_sample_value(metrics.PREFIX + "map_held", {"namespace": "prod", "name": "chat", "reason": "VerificationFailed"}) is None


async def test_an_invalid_map_being_deleted_is_withdrawn_not_held():
    """Finding 10: an invalid map being deleted was held, so its route stayed."""
    publisher, stores, gateway = make_publisher()
    put_map(stores, make_map())
    await publisher.start()
    publisher.synced()
    await publisher.sync_once(publisher.queue.take_ready())
    bad = make_map(resource_version="2", metadata={"deletionTimestamp": "2026-12-01T00:00:00Z"},
                   entries=[make_entry("worker-a", weight=-1)])
    tm = parse_traffic_map(bad)
    stores.maps.upsert(CHAT, tm, "2")
    publisher.changed([CHAT], at=0.0)
    await publisher.sync_once(publisher.queue.take_ready())
    assert gateway.held == {}
    assert publisher.states[CHAT].state == "withdrawn"


async def test_a_resync_feeds_the_queue_a_slice_at_a_time():
    """Finding 11: one resync pass of every map held the event loop (0.75 s at 10,000 maps)."""
    publisher, stores, gateway = make_publisher(resync=0.01)
    for i in range(loop.DECIDE_SLICE * 2 + 5):
        put_map(stores, make_map(f"m{i}"), isvc=make_isvc(f"m{i}"))
    await publisher.start()
    publisher.synced()
    await publisher.sync_once(publisher.queue.take_ready())
    resync = asyncio.create_task(publisher.run_resync())
    for _ in range(100):
        await asyncio.sleep(0.01)
        if publisher.resync:
            break
    resync.cancel()
    await asyncio.gather(resync, return_exceptions=True)
    assert 0 < len(publisher.queue) <= loop.DECIDE_SLICE
    publisher.changed([MapKey("prod", "fresh")], at=0.0)
    taken = publisher.queue.take_ready()
    assert MapKey("prod", "fresh") in taken and len(taken) <= loop.DECIDE_SLICE + 1


class PagedMemoryGateway(MemoryGateway):
    """The memory gateway read a page at a time (as --json-dir is), logging each read and write;
    `during_page` runs inside each page's read (an event that arrives meanwhile)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, frozenset[MapKey]]] = []
        self.during_page: Callable[[int], None] = lambda page: None

    async def read(self):
        self.log.append(("read", frozenset(self.held)))
        return await super().read()

    async def read_page(self, keys):
        self.log.append(("page", frozenset(keys)))
        self.during_page(sum(what == "page" for what, _ in self.log))
        return {key: self.held[key] for key in keys if key in self.held}

    async def read_others(self, known):
        self.log.append(("others", frozenset(self.held.keys() - set(known))))
        return {key: route for key, route in self.held.items() if key not in known}

    async def write(self, parts, changes):
        self.log.append(("write", frozenset(changes)))
        return await super().write(parts, changes)


async def resync_to_its_end(publisher: Publisher, gateway: PagedMemoryGateway, applier: asyncio.Task) -> None:
    """A resync, served by `applier` until its last page is read and the loop is idle; then the
    applier is stopped."""
    publisher.resync_now()
    try:
        await eventually(lambda: any(what == "others" for what, _ in gateway.log))
        await loop_idle(publisher)
    finally:
        applier.cancel()
        await asyncio.gather(applier, return_exceptions=True)


async def test_a_paged_read_back_goes_a_page_at_a_time_with_fresh_changes_applied_between_pages():
    """Issue 29: a resync read the whole gateway before anything else (--json-dir: 200-450 ms at
    10,000 maps), and changes arriving meanwhile waited for it. A gateway that reads in pages is
    read back a slice at a time, each before the slice is decided again, with what changed
    meanwhile written before the next page is read; the last page reads what else it serves."""
    publisher, stores, gateway = make_publisher(PagedMemoryGateway())
    assert isinstance(gateway, PagedMemoryGateway)
    keys = [put_map(stores, make_map(f"m{i:04}"), isvc=make_isvc(f"m{i:04}")) for i in range(loop.DECIDE_SLICE * 2 + 5)]
    await publisher.start()
    publisher.synced()
    applier = asyncio.create_task(publisher.run_applier())
    await loop_idle(publisher)
    fresh = MapKey("prod", "m0300")
    gateway.held.pop(MapKey("prod", "m0007"))  # drift a page repairs

    def meanwhile(page: int) -> None:
        if page == 1:  # an event arrives
            put_map(stores, make_map("m0300", resource_version="2", entries=[make_entry("worker-a", allocated=5, ready=5, weight=1)]), isvc=make_isvc("m0300"))
            publisher.changed([fresh], at=0.0)
        if page == 3:  # a hand adds a map: only the last page's read of what else is served sees it
            gateway.held[MapKey("prod", "stray")] = gateway.held[MapKey("prod", "m0001")]

    gateway.during_page = meanwhile
    gateway.log.clear()
    await resync_to_its_end(publisher, gateway, applier)
    reads = [what for what, _ in gateway.log if what != "write"]
    assert reads == ["page", "page", "page", "others"]  # no read of the whole gateway
    pages = [keys_read for what, keys_read in gateway.log if what == "page"]
    assert all(len(page) <= loop.DECIDE_SLICE for page in pages) and set().union(*pages) == set(keys)
    fresh_write = next(i for i, (what, written) in enumerate(gateway.log) if what == "write" and fresh in written)
    second_page = [i for i, (what, _) in enumerate(gateway.log) if what == "page"][1]
    assert fresh_write < second_page and fresh not in pages[0]
    assert [b.cluster for b in gateway.held[fresh].backends] == ["worker-a"] and MapKey("prod", "m0007") in gateway.held
    assert MapKey("prod", "stray") not in gateway.held


async def test_a_resync_rests_between_its_slices_as_long_as_the_last_took_and_a_change_ends_the_rest():
    """Issue 29: a resync's slices ran back to back, so a read-back and re-decide of 10,000 maps
    kept the event loop busy for half a second (yielding between slices, but saturated). The
    applier now rests before each next slice as long as the pass took (at most RESYNC_REST_CAP),
    waiting on its queue: a change arriving meanwhile ends the rest and is taken at once."""
    clock = FakeClock()
    gateway = PagedMemoryGateway()
    stores = Stores.empty()
    publisher = Publisher(stores, memory_engine(gateway)[0], LoopOptions(adapter_name="memory"), clock=clock)
    for i in range(loop.DECIDE_SLICE * 3 + 1):
        put_map(stores, make_map(f"m{i:04}"), isvc=make_isvc(f"m{i:04}"))
    await publisher.start()
    publisher.synced()
    applier = asyncio.create_task(publisher.run_applier())
    await loop_idle(publisher)
    took = iter([0.02, 0.3, 0.01, 0.02])  # each page's read, as the clock sees it

    def page_read(page: int) -> None:
        clock.now += next(took)

    rests: list[tuple[float, bool]] = []
    waiting = publisher.queue.wait

    async def rest_or_wait(timeout: float | None = None) -> bool:
        if timeout is None:
            return await waiting()
        if len(rests) == 1:  # a change arrives during the second rest
            publisher.changed([MapKey("prod", "m0000")], at=0.0)
        rests.append((timeout, await waiting(timeout)))
        return rests[-1][1]

    publisher.queue.wait = rest_or_wait  # type: ignore[method-assign]
    gateway.during_page = page_read
    await resync_to_its_end(publisher, gateway, applier)
    # The change's own pass rests as long as it took (0 by this clock); none after the last slice.
    assert [timeout for timeout, _ in rests] == pytest.approx([0.02, RESYNC_REST_CAP, 0.0, 0.01])
    assert [ended_by_a_change for _, ended_by_a_change in rests] == [False, True, False, False]


class CountingSink:
    """A status sink that counts the verdicts it was handed to compare, per map."""

    def __init__(self) -> None:
        self.compared: Counter[MapKey] = Counter()
        self.stale_calls = 0

    def stale(self) -> None:
        self.stale_calls += 1

    async def write(self, verdicts):
        self.compared.update(verdicts.keys())
        return {}


async def test_a_resync_compares_each_verdict_with_the_server_once():
    """Issue 29: a resync queued every verdict for comparison at its start and again as its slices
    were settled: every map's condition compared twice a minute, a 235 ms busy run at 10,000 maps.
    The sink is told to read the server again; each verdict is compared once, as its map settles."""
    sink = CountingSink()
    stores = Stores.empty()
    publisher = Publisher(stores, memory_engine()[0], LoopOptions(adapter_name="memory", status_delay=0.0), status_sink=sink)
    keys = {put_map(stores, make_map(f"m{i:04}"), isvc=make_isvc(f"m{i:04}")) for i in range(loop.DECIDE_SLICE * 2 + 5)}
    await publisher.start()
    publisher.synced()
    tasks = [asyncio.create_task(publisher.run_applier()), asyncio.create_task(publisher.outbox.run())]
    try:
        await eventually(lambda: set(sink.compared) == keys)
        sink.compared.clear()
        publisher.resync_now()
        await eventually(lambda: not len(publisher.resync) and not len(publisher.queue) and publisher.applier_idle.is_set()
                         and not len(publisher.outbox.due) and set(sink.compared) == keys)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert set(sink.compared.values()) == {1} and sink.stale_calls == 1


async def test_a_pass_of_many_maps_lets_other_tasks_run_while_it_decides():
    """The first pass decided every map in one go: 0.4 s of the event loop at 10,000 maps, in which
    no gateway stream, status write or /readyz ran. It yields after each slice of maps."""
    publisher, stores, _ = make_publisher()
    count = loop.DECIDE_SLICE * 3
    for i in range(count):
        put_map(stores, make_map(f"m{i}"), isvc=make_isvc(f"m{i}"))
    await publisher.start()
    publisher.synced()
    decided = 0
    decide = publisher.decide

    def counting(key):
        nonlocal decided
        decided += 1
        return decide(key)

    publisher.decide = counting  # type: ignore[method-assign]
    seen: list[int] = []

    async def bystander() -> None:
        while decided < count:
            seen.append(decided)
            await asyncio.sleep(0)

    watcher = asyncio.create_task(bystander())
    await asyncio.sleep(0)
    await publisher.sync_once(publisher.queue.take_ready())
    await watcher
    assert any(0 < n < count for n in seen), seen


async def test_the_first_list_runs_with_rare_collections_and_the_default_comes_back_after_the_first_sync():
    """Listing 10,000 maps under the collector's default trigger spent half its CPU rescanning
    what it had just listed; the trigger is raised until the first sync, then put back."""
    import gc

    default = gc.get_threshold()
    publisher, stores, adapter = make_publisher()
    during_list: list[tuple[int, ...]] = []
    release = asyncio.Event()

    async def listing() -> None:
        during_list.append(gc.get_threshold())
        await release.wait()

    task = asyncio.create_task(loop.run(publisher, OneMapSource(publisher, stores, before=listing)))
    try:
        while not during_list:
            await asyncio.sleep(0.01)
        assert during_list[0][0] == loop.STARTUP_GC_THRESHOLD > default[0]
        release.set()
        while CHAT not in adapter.held:
            await asyncio.sleep(0.01)
        for _ in range(100):
            if gc.get_threshold() == default:
                break
            await asyncio.sleep(0.01)
        assert gc.get_threshold() == default
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        gc.unfreeze()
    assert gc.get_threshold() == default


async def test_start_up_collects_only_the_young_generation_and_the_first_sync_freezes_without_a_full_collection(monkeypatch):
    """Issue 29: at 10,000 maps a collection of the older generations during the first list
    walked all of it (35-45 ms), and the full collection before the first sync's freeze held the
    event loop 300-375 ms while the first changes waited."""
    import gc

    default = gc.get_threshold()
    publisher, stores, adapter = make_publisher()
    during_list: list[tuple[int, ...]] = []
    collections: list[tuple[object, ...]] = []
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(args) or 0)

    async def listing() -> None:
        during_list.append(gc.get_threshold())

    task = asyncio.create_task(loop.run(publisher, OneMapSource(publisher, stores, before=listing)))
    try:
        for _ in range(100):
            if gc.get_threshold() == default and CHAT in adapter.held:
                break
            await asyncio.sleep(0.01)
        assert gc.get_threshold() == default and CHAT in adapter.held
        assert during_list == [(loop.STARTUP_GC_THRESHOLD, loop.STARTUP_GC_OLDER, default[2])]
        assert collections == []
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        gc.unfreeze()


async def test_a_sidecar_stopped_before_its_first_sync_puts_the_collector_back():
    import gc

    default = gc.get_threshold()
    publisher, _, _ = make_publisher()

    class SilentSource:
        async def run(self) -> None:
            await asyncio.Event().wait()

        def problem(self) -> None:
            return None

    task = asyncio.create_task(loop.run(publisher, SilentSource()))
    for _ in range(100):
        if gc.get_threshold() != default:
            break
        await asyncio.sleep(0.01)
    assert gc.get_threshold()[0] == loop.STARTUP_GC_THRESHOLD
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert gc.get_threshold() == default


async def test_a_deleted_maps_records_are_dropped_its_prober_note_and_status_backoff_too(caplog):
    """Issue 21, finding 8: a deleted map's stalled-prober note and status backoff stayed forever:
    a map of the same name later had its stalled prober go unlogged, and its status writes started
    from the old backoff."""
    publisher, stores, gateway = make_publisher(probe_max_age=60.0)
    stale = make_entry("worker-a", allocated=1, ready=1, weight=1,
                       probe={"result": "Passing", "gated": False, "lastProbeTime": "2020-01-01T00:00:00Z"})
    raw = make_map(entries=[stale])
    put_map(stores, raw)
    await publisher.start()
    publisher.synced()
    await publisher.sync_once(publisher.queue.take_ready())
    assert publisher.states[CHAT].state == "published"
    publisher.outbox.backoff.delay(CHAT)  # a status write of it failed
    stores.maps.delete(CHAT)
    publisher.changed([CHAT], at=0.0)
    await publisher.sync_once(publisher.queue.take_ready())
    assert CHAT not in gateway.held and CHAT not in publisher.states
    assert publisher.outbox.backoff.failures(CHAT) == 0
    put_map(stores, raw)
    publisher.changed([CHAT], at=0.0)
    await publisher.sync_once(publisher.queue.take_ready())
    assert [r.getMessage() for r in caplog.records].count("prober stalled") == 2, "the new map's stalled prober is news"


# --- issue 21: the loop's side of partial failures ------------------------------------------------


def publications(result: str) -> float:
    from publisher import metrics

    return metrics.REGISTRY.get_sample_value(metrics.PREFIX + "publications_total", {"adapter": "memory", "result": result}) or 0.0


async def test_a_late_refusal_holds_the_map_apply_failed_and_retries_it(caplog):
    """Finding 4: a client that connected later refused a map; it stayed Published and each resync
    logged "gateway drift repaired" for it, forever."""
    clock = FakeClock()
    gateway = MemoryGateway()
    stores = Stores.empty()
    publisher = Publisher(stores, memory_engine(gateway)[0], LoopOptions(adapter_name="memory", backoff_base=1.0), clock=clock)
    put_map(stores, make_map())
    await publisher.start()
    publisher.synced()
    await publisher.sync_once(publisher.queue.take_ready())
    assert publisher.states[CHAT].state == "published"
    gateway.refused_later = {CHAT: "envoy-2: unknown cluster worker-b"}
    with caplog.at_level("WARNING", logger="publisher.loop"):
        await publisher.reconcile()
    assert not [r for r in caplog.records if r.getMessage() == "gateway drift repaired"]
    assert publisher.states[CHAT].reason == Reason.APPLY_FAILED
    assert "envoy-2: unknown cluster worker-b" in publisher.states[CHAT].message
    # Retried with backoff: the same route is written again, and published once taken.
    writes = len(gateway.applies)
    assert publisher.queue.take_ready() == {}
    clock.now += 1.0
    await publisher.sync_once(publisher.queue.take_ready())
    assert len(gateway.applies) == writes + 1
    assert publisher.states[CHAT].state == "published"


async def test_a_map_the_gateway_lost_during_an_unknown_write_is_written_again():
    """Finding 5: after Unavailable, the read-back silently dropped a map the gateway had lost; it
    stayed published, and nothing rewrote it until the next full re-decide."""
    publisher, stores, gateway = make_publisher()
    put_map(stores, make_map())
    embed = put_map(stores, make_map("embed"), isvc=make_isvc("embed"))
    await publisher.start()
    publisher.synced()
    await publisher.sync_once(publisher.queue.take_ready())
    gateway.fail_with = [Unavailable("timed out confirming")]
    put_map(stores, make_map("embed", resource_version="2",
                             entries=[make_entry("worker-a", allocated=2, ready=2, weight=1, service="embed")]),
            isvc=make_isvc("embed"))
    publisher.changed([embed], at=0.0)
    await publisher.sync_once(publisher.queue.take_ready())
    del gateway.held[CHAT]  # lost meanwhile
    publisher.changed([embed], at=0.0)
    await publisher.sync_once(publisher.queue.take_ready())
    assert CHAT in publisher.queue.take_ready()
    publisher.changed([CHAT], at=0.0)
    await publisher.sync_once(publisher.queue.take_ready())
    assert weights(gateway, CHAT) == [2, 3]
    assert publisher.states[CHAT].state == "published"


async def test_maps_wait_pending_while_no_gateway_client_is_connected():
    """Finding 7: with no Envoy connected every map was ApplyFailed, counted as a failed
    publication and its condition flipped, until one connected."""
    from adapters.base import NotConnected

    clock = FakeClock()
    gateway = MemoryGateway(fail_with=[NotConnected("no Envoy connected")])
    stores = Stores.empty()
    publisher = Publisher(stores, memory_engine(gateway)[0], LoopOptions(adapter_name="memory"), status_sink=object(), clock=clock)  # type: ignore[arg-type]
    put_map(stores, make_map())
    await publisher.start()
    publisher.synced()
    failed = publications("failed")
    await publisher.sync_once(publisher.queue.take_ready())
    assert publisher.states[CHAT].state == "pending" and publisher.states[CHAT].reason is None
    assert "no Envoy connected" in publisher.states[CHAT].message
    assert publications("failed") == failed
    assert CHAT not in publisher.outbox.verdicts  # no condition is written, so none flips
    assert publisher.ready() == (False, "waiting for the gateway: no Envoy connected")
    clock.now += loop.PENDING_RETRY_CAP
    await publisher.sync_once(publisher.queue.take_ready())
    assert publisher.states[CHAT].state == "published" and publisher.outbox.verdicts[CHAT].reason == Reason.PUBLISHED
    assert publisher.ready() == (True, "ready")


async def test_start_waits_for_a_gateway_client_instead_of_failing():
    """Finding 7: a sidecar started before its gateway stopped at once."""
    from adapters.base import NotConnected

    class LateGateway(MemoryGateway):
        refusals_left: int = 2

        async def read(self):
            if self.refusals_left:
                self.refusals_left -= 1
                raise NotConnected("no NGINX control listener at 127.0.0.1:8082")
            return await super().read()

    publisher, _, gateway = make_publisher(LateGateway(), backoff_base=0.01)
    starting = asyncio.create_task(publisher.start())
    for _ in range(100):
        await asyncio.sleep(0.005)
        if publisher.gateway.waiting:
            break
    assert publisher.ready() == (False, "gateway not read yet: no NGINX control listener at 127.0.0.1:8082")
    await asyncio.wait_for(starting, 5)
    assert publisher.started and gateway.reads == 1


async def test_after_a_restart_two_maps_on_one_hostname_leave_the_older_serving_it():
    """Finding 1: a gateway holding one hostname for two maps (left by hand or an older sidecar)
    kept serving both, and both were Published."""
    young = make_map(metadata={"creationTimestamp": "2026-05-01T00:00:00Z"})
    old = make_map("chat-copy", metadata={"creationTimestamp": "2026-01-01T00:00:00Z"})
    old_isvc = make_isvc("chat-copy", host="chat.example.com")
    gateway = MemoryGateway()
    for raw, isvc in ((young, None), (old, old_isvc)):
        alone, stores, written = make_publisher()
        put_map(stores, raw, isvc=isvc)
        await alone.start()
        alone.synced()
        await alone.sync_once(alone.queue.take_ready())
        gateway.held.update(written.held)
    copy = MapKey("prod", "chat-copy")
    assert {route.hostname for route in gateway.held.values()} == {"chat.example.com"} and len(gateway.held) == 2
    restarted, stores, _ = make_publisher(gateway)
    put_map(stores, young)
    put_map(stores, old, isvc=old_isvc)
    await restarted.start()
    restarted.synced()
    await restarted.sync_once(restarted.queue.take_ready())
    assert set(gateway.held) == {copy}
    assert restarted.states[CHAT].reason == Reason.HOST_CONFLICT
    assert restarted.states[copy].state == "published"


class RecordedSplit:
    """The served-split check's side of the loop: the routes it was told the gateway serves."""

    def __init__(self) -> None:
        self.routes: list[object] = []

    def route_confirmed(self, key: MapKey, route: object) -> None:
        self.routes.append(route)

    def note(self, key: MapKey) -> None:
        return None


async def test_a_map_held_back_on_some_clients_is_apply_failed_yet_its_served_weights_are_followed():
    """Issue 30: a map some Envoys refused while the others serve it is confirmed (the others
    serve it) yet not published. The split check and the weights series were told nothing of it,
    then nothing again when a retry published it (the confirmed route no longer changed): the
    check judged the others' traffic against the old weights."""
    clock = FakeClock()
    gateway = MemoryGateway()
    stores = Stores.empty()
    publisher = Publisher(stores, memory_engine(gateway)[0], LoopOptions(adapter_name="memory", backoff_base=1.0),
                          status_sink=object(), clock=clock)  # type: ignore[arg-type]
    split = RecordedSplit()
    publisher.split = split  # type: ignore[assignment]
    put_map(stores, make_map())
    await publisher.start()
    publisher.synced()
    await publisher.sync_once(publisher.queue.take_ready())
    assert publisher.states[CHAT].state == "published"
    gateway.held_back = {CHAT: "envoy rogue refused the route: no; held back on those; 1 other Envoy serves it"}
    put_map(stores, make_map(resource_version="2", entries=[make_entry("worker-a", allocated=3, ready=3, weight=1)]))
    publisher.changed([CHAT], at=clock.now)
    await publisher.sync_once(publisher.queue.take_ready())
    assert publisher.states[CHAT].reason == Reason.APPLY_FAILED
    # The condition says where the older weights stay: on the refusers alone.
    assert publisher.outbox.verdicts[CHAT].message.endswith("envoy rogue refused the route: no; held back on those; 1 other Envoy serves it; "
                                                    "where refused, the gateway keeps generation 3")
    new = gateway.held[CHAT]
    assert split.routes[-1] == new  # the others serve it: the check follows them
    gateway.held_back = {}
    clock.now += 1.0
    await publisher.sync_once(publisher.queue.take_ready())
    assert publisher.states[CHAT].state == "published" and split.routes[-1] == new


async def test_starting_on_a_gateway_serving_many_maps_gives_the_event_loop_back_between_slices():
    # Issue 29: after the engine's read-back (in slices of its own) the loop set each map's
    # weight series and queued it, 10,000 maps in one turn.
    from publisher.core.values import Backend, Route

    held = {MapKey("prod", f"m{i}"): Route(f"m{i}.example.com", (Backend("w0", "http://10.0.0.1:80", 1),)) for i in range(5000)}
    publisher, _, _ = make_publisher(MemoryGateway(held=dict(held)))
    async with loop_turns() as turns:
        await publisher.start()
        slices = 5000 // loop.DECIDE_SLICE
        # The engine's read-back gives the loop back once a slice; setting the series, as often.
        assert turns() >= 2 * slices - 2, f"starting on 5,000 maps let other tasks run {turns()} times"
    assert len(publisher.queue) == 5000


async def test_a_pass_of_many_maps_gives_the_event_loop_back_while_it_settles():
    # Issue 29: the first pass of 10,000 maps recorded its metrics (70 ms) and settled every map
    # (85 ms) in one turn of the event loop each, while status writes and xDS pushes waited.
    publisher, stores, adapter = make_publisher()
    keys = [put_map(stores, make_map(name=f"m{i}")) for i in range(10 * loop.DECIDE_SLICE)]
    await publisher.start()
    publisher.changed(keys, at=0.0)
    publisher.synced()
    async with loop_turns() as turns:
        await publisher.sync_once(publisher.queue.take_ready())
        # Deciding and rendering give the loop back once a slice; recording and settling too.
        assert turns() >= 3 * 10, f"a pass of {len(keys)} maps let other tasks run {turns()} times"
    assert len(adapter.held) == len(keys) and publisher.states.count("published") == len(keys)


async def test_the_status_writers_turn_comes_once_the_applier_finished_its_pass():
    """Status writes start between the applier's passes, not beside them: gateway_turn waits
    while the applier is in a pass (at most STATUS_YIELD_CAP, so status is never starved)."""
    publisher, stores, _ = make_publisher()
    assert publisher.applier_idle.is_set()  # no applier running: nothing to wait for
    await publisher.gateway_turn()
    publisher.applier_idle.clear()  # as in a pass
    turn = asyncio.create_task(publisher.gateway_turn())
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not turn.done()
    publisher.applier_idle.set()
    await asyncio.wait_for(turn, 5)
    publisher.applier_idle.clear()
    await asyncio.wait_for(publisher.gateway_turn(), 5)  # a pass that never ends holds it back at most the cap
