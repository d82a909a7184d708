"""The loop's parts without I/O: deciding a map, a pass's batch for the engine, map states and
their counts, a resync's backlog, the /debug/maps view, and the status outbox against a sink in
memory."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from publisher.core.model import parse_traffic_map

from publisher.core.values import Held, MapKey, Reason, Route
from publisher.core.plan import Hold, Publish, Withdraw
from publisher.loop import KeyQueue, LoopOptions, MapState
from publisher.loop.debug import debug_maps, probe_ages
from publisher.loop.decide import Decisions, decide, engine_batch
from publisher.loop.keys import ResyncBacklog
from publisher.loop.options import DECIDE_SLICE, STATUS_CHUNK
from publisher.loop.outbox import StatusOutbox
from publisher.loop.states import MapStates, StateChange
from publisher.source.objects import parse_isvc
from publisher.source.store import Stores
from publisher.status import Verdict
from tests.builders import make_condition, make_entry, make_isvc, make_map
from tests.gateways import eventually

CHAT = MapKey("prod", "chat")
EMBED = MapKey("prod", "embed")
OPTIONS = LoopOptions()


def stores_with(*raws: dict) -> Stores:
    stores = Stores.empty()
    for raw in raws:
        tm = parse_traffic_map(raw)
        stores.maps.upsert(tm.key, tm, raw["metadata"]["resourceVersion"])
        isvc = make_isvc(raw["metadata"]["name"], raw["metadata"]["namespace"])
        stores.isvcs.upsert(tm.key, parse_isvc(isvc), isvc["metadata"]["resourceVersion"])
    return stores


def accept(_publication) -> None:
    return None


# --- deciding ---------------------------------------------------------------------------------------


def test_a_map_that_passes_every_gate_is_published_with_its_weights():
    outcome = decide(CHAT, stores_with(make_map(entries=[make_entry("worker-a", allocated=2, ready=2, weight=2), make_entry("worker-b", weight=1)])), OPTIONS, accept)
    assert isinstance(outcome, Publish)
    assert [(b.cluster, b.weight) for b in outcome.publication.backends] == [("worker-a", 2), ("worker-b", 1)]


def test_a_map_without_a_current_routable_condition_is_held():
    outcome = decide(CHAT, stores_with(make_map(routable=False)), OPTIONS, accept)
    assert isinstance(outcome, Hold) and outcome.held.reason == Reason.ROUTABLE_OUTDATED


def test_a_map_gone_from_the_source_is_withdrawn():
    assert isinstance(decide(CHAT, Stores.empty(), OPTIONS, accept), Withdraw)


def test_what_the_adapter_cannot_serve_is_held_with_its_words():
    refused = Held(Reason.APPLY_FAILED, "no such hostname here")
    outcome = decide(CHAT, stores_with(make_map()), OPTIONS, lambda _publication: refused)
    assert outcome == Hold(refused)


def test_a_map_whose_objects_did_not_change_is_not_decided_again():
    """A resync re-decided every map: 10,000 gates, verifies and plans a minute whose outcome
    could not differ (a decision reads no clock). Now a map is decided again only when the Stores
    hold another object for it (our own condition aside) or its InferenceService."""
    stores = stores_with(make_map(), make_map("embed"))
    checked: list[str] = []

    def check(publication):
        checked.append(publication.route.hostname)
        return None

    decisions = Decisions(stores, OPTIONS, check)
    first = {key: decisions(key) for key in (CHAT, EMBED)}
    assert len(checked) == 2
    assert {key: decisions(key) for key in (CHAT, EMBED)} == first and len(checked) == 2  # a resync

    changed = make_map(entries=[make_entry("worker-a", allocated=2, ready=2, weight=2), make_entry("worker-b", weight=1)], resource_version="9")
    stores.maps.upsert(CHAT, parse_traffic_map(changed), "9")
    outcome = decisions(CHAT)
    assert len(checked) == 3 and outcome == decide(CHAT, stores, OPTIONS, accept) != first[CHAT]
    isvc = make_isvc("embed", "prod", resource_version="9")
    stores.isvcs.upsert(EMBED, parse_isvc(isvc), "9")
    decisions(EMBED)
    assert len(checked) == 4  # its InferenceService is another object
    stores.maps.delete(EMBED)
    assert isinstance(decisions(EMBED), Withdraw)


def test_a_map_stored_again_with_only_our_condition_changed_is_not_decided_again():
    # Issue 29: the echo of our own condition write is stored (the status writer reads it), but a
    # new object made every map that got one (all of them, after a start) decided again at the
    # next resync.
    stores = stores_with(make_map())
    checked = []
    decisions = Decisions(stores, OPTIONS, lambda publication: checked.append(publication) and None)
    first = decisions(CHAT)
    echo = make_map(resource_version="9")
    echo["status"]["conditions"].append(make_condition("gateway-publisher.ome.io/eu", reason="Published"))
    stores.maps.upsert(CHAT, parse_traffic_map(echo), "9", decided_alike=True)
    assert decisions(CHAT) is first and len(checked) == 1
    stores.maps.upsert(CHAT, parse_traffic_map(make_map(resource_version="10")), "10")
    assert decisions(CHAT) == first and len(checked) == 2  # anything else stored is decided again


# --- a pass's batch -------------------------------------------------------------------------------


def test_the_batch_holds_every_publish_and_withdraw_and_names_what_would_change():
    stores = stores_with(make_map(), make_map("embed"))
    published = decide(CHAT, stores, OPTIONS, accept)
    same = decide(EMBED, stores, OPTIONS, accept)
    assert isinstance(published, Publish) and isinstance(same, Publish)
    held_key, gone_key = MapKey("prod", "held"), MapKey("prod", "gone")
    gone_route = Route("gone.example.com", ())
    outcomes = {CHAT: published, EMBED: same, held_key: Hold(Held(Reason.ROUTABLE_OUTDATED, "m")), gone_key: Withdraw("gone")}
    confirmed = {EMBED: same.publication.route, gone_key: gone_route, held_key: gone_route}
    batch = engine_batch(outcomes, confirmed, failing=lambda key: False)
    assert batch.decided == {CHAT: published.publication, EMBED: same.publication, gone_key: None}
    assert batch.before == {CHAT: None, EMBED: same.publication.route, gone_key: gone_route}
    assert batch.changes == {CHAT, gone_key}
    # A map whose last write failed is written again, its route unchanged or not.
    assert engine_batch(outcomes, confirmed, failing=lambda key: key == EMBED).changes == {CHAT, EMBED, gone_key}


# --- map states and their counts --------------------------------------------------------------------


def test_map_states_count_each_state_and_say_what_changed():
    states = MapStates()
    assert states.state(CHAT) == MapState() and states.count("pending") == 0
    first = MapState("held", "RoutableOutdated", "m")
    assert states.set(CHAT, first) == StateChange(None, first)
    assert states.set(EMBED, MapState("published")) is not None
    assert (states.count("held"), states.count("published")) == (1, 1)
    # Only the message is new: no change, the count stands, the message is kept.
    assert states.set(CHAT, MapState("held", "RoutableOutdated", "later")) is None
    assert states[CHAT].message == "later" and states.count("held") == 1
    # Another reason in the same state is a change; the count stands.
    assert states.set(CHAT, MapState("held", "VerificationFailed", "v")) is not None
    assert states.count("held") == 1
    published = MapState("published")
    assert states.set(CHAT, published) == StateChange(MapState("held", "VerificationFailed", "v"), published)
    assert (states.count("held"), states.count("published")) == (0, 2)
    assert states.forget(CHAT) == published and states.forget(CHAT) is None
    assert states.count("published") == 1 and dict(states) == {EMBED: MapState("published")}


# --- a resync's backlog ---------------------------------------------------------------------------


def test_a_resync_feeds_its_keys_a_slice_at_a_time_only_to_an_empty_queue():
    queue = KeyQueue(lambda: 0.0)
    backlog = ResyncBacklog(queue)
    keys = [MapKey("prod", f"m{i:05}") for i in range(DECIDE_SLICE + 10)]
    queue.add(CHAT)
    backlog.request(keys)
    assert len(queue) == 1 and len(backlog) == len(keys)  # a fresh event goes first
    assert backlog.take_reconcile() and not backlog.take_reconcile()
    queue.take_ready()
    backlog.feed()
    assert sorted(queue.take_ready()) == keys[:DECIDE_SLICE]  # in key order
    backlog.feed()
    assert sorted(queue.take_ready()) == keys[DECIDE_SLICE:] and len(backlog) == 0


def test_a_resync_of_a_gateway_read_in_pages_reads_each_slice_before_it_is_decided():
    queue = KeyQueue(lambda: 0.0)
    backlog = ResyncBacklog(queue, pages=True)
    keys = [MapKey("prod", f"m{i:05}") for i in range(DECIDE_SLICE + 10)]
    backlog.request(keys)
    assert not backlog.take_reconcile()  # no read of the whole gateway
    page, last = backlog.take_page()
    assert sorted(page) == sorted(queue.take_ready()) == keys[:DECIDE_SLICE] and not last
    assert backlog.take_page() is None
    backlog.feed()
    page, last = backlog.take_page()
    assert sorted(page) == keys[DECIDE_SLICE:] and last
    backlog.request([])
    assert backlog.take_page() == ([], True)  # no map to decide: what else the gateway serves


# --- /debug/maps -------------------------------------------------------------------------------------


def test_the_debug_view_says_per_map_what_was_decided_and_what_is_served():
    entry = make_entry("worker-a", gated=False)
    entry["probe"]["lastProbeTime"] = "2026-12-06T09:59:30Z"
    stores = stores_with(make_map(entries=[entry]))
    publication = decide(CHAT, stores, OPTIONS, accept)
    assert isinstance(publication, Publish)
    states = MapStates()
    states.set(CHAT, MapState("published"))
    now = datetime(2026, 12, 6, 10, 0, 0, tzinfo=UTC)
    maps = debug_maps(
        {CHAT, EMBED},
        states=states,
        published={CHAT: publication.publication.route},
        provenance={CHAT: publication.publication},
        objects=stores.maps.get,
        wall_clock=lambda: now,
        adapter_name="json",
        served_by=None,
        split=None,
    )
    assert [(m["name"], m["decision"], m["publishedGeneration"]) for m in maps] == [("chat", "published", 3), ("embed", "pending", None)]
    assert maps[0]["weights"] == {"worker-a": 1} and maps[0]["probeAgeSeconds"] == {"worker-a": 30}
    assert "envoys" not in maps[0] and maps[1]["hostname"] is None
    assert probe_ages(None, now) is None


# --- the status outbox: its delay and leader gate, against a sink in memory -----------------------


class RecordingSink:
    def __init__(self) -> None:
        self.written: list[dict] = []
        self.stale_calls = 0

    def stale(self) -> None:
        self.stale_calls += 1

    async def write(self, reports):
        self.written.append(dict(reports))
        return {}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_the_outbox_holds_back_a_verdict_other_than_published_and_only_the_leader_writes():
    sink, clock = RecordingSink(), Clock()
    outbox = StatusOutbox(sink, LoopOptions(status_delay=0.5), clock)
    held = Verdict(False, Reason.ROUTABLE_OUTDATED, "m", 3, "uid")
    served = Verdict(True, Reason.PUBLISHED, "served", 3, "uid")
    outbox.put(CHAT, held)
    outbox.put(EMBED, served)
    await outbox.write(outbox.due.take_ready())
    assert sink.written == [{EMBED: served}]  # the hold has not stood long enough
    clock.now += 0.5
    await outbox.write(outbox.due.take_ready())
    assert sink.written[-1] == {CHAT: held}
    outbox.follow()
    outbox.put(CHAT, served)
    await outbox.write(outbox.due.take_ready())
    assert len(sink.written) == 2 and outbox.verdicts[CHAT] == served  # a follower keeps, never writes
    outbox.lead()
    assert sink.stale_calls == 1 and set(outbox.due.take_ready()) == {CHAT, EMBED}
    outbox.forget(CHAT)
    await outbox.write(outbox.due.take_ready())
    assert sink.written[-1] == {CHAT: None} and CHAT not in outbox.verdicts


async def test_without_a_sink_the_outbox_keeps_nothing():
    outbox = StatusOutbox(None, LoopOptions(), Clock())
    outbox.put(CHAT, Verdict(True, Reason.PUBLISHED, "served", 3, "uid"))
    assert outbox.verdicts == {} and not outbox.leading and len(outbox.due) == 0


async def test_the_status_writer_hands_its_sink_chunks_each_after_the_gateways_turn():
    """10,000 first conditions at start went to the sink in one batch, beside the applier's
    writes: the changes arriving then waited behind the writes' responses. The writer now takes
    chunks of STATUS_CHUNK and lets the gateway's work go first before each."""
    sink, clock = RecordingSink(), Clock()
    events: list[str] = []

    async def gateway_turn() -> None:
        events.append("turn")

    original = sink.write

    async def write(reports):
        events.append(f"write {len(reports)}")
        return await original(reports)

    sink.write = write
    outbox = StatusOutbox(sink, OPTIONS, clock, gateway_turn)
    served = Verdict(True, Reason.PUBLISHED, "served", 3, "uid")
    for i in range(STATUS_CHUNK * 2 + 5):
        outbox.put(MapKey("prod", f"m{i:03d}"), served)
    running = asyncio.create_task(outbox.run())
    try:
        await eventually(lambda: len(events) == 6, timeout=10)
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    assert events == ["turn", f"write {STATUS_CHUNK}", "turn", f"write {STATUS_CHUNK}", "turn", "write 5"]


async def test_a_key_queue_waiter_cancelled_as_a_key_arrives_ends():
    """A test's shutdown hung in CI: the status writer, cancelled in the same turn as a key woke
    it, kept waiting for keys forever. Python 3.11's asyncio.wait_for, which KeyQueue.wait used,
    returns the result when its cancellation and its result come together, and the cancellation
    is lost; asyncio.timeout keeps it."""
    queue = KeyQueue()
    queue.add_after(EMBED, 3600)  # a delayed key: the wait has a timeout, as the status writer's has

    async def consume() -> None:
        while True:
            await queue.take()

    consumer = asyncio.create_task(consume())
    for _ in range(3):
        await asyncio.sleep(0)  # waiting now
    queue.add(CHAT)
    await asyncio.sleep(0)  # the wake-up is under way
    consumer.cancel()
    done, _ = await asyncio.wait({consumer}, timeout=5)
    assert consumer in done and consumer.cancelled()
