"""publisher/split/check.py: the served-split check in the loop: windows follow confirmed routes,
an off split is named in the map's condition message, /debug/maps and metrics, and never holds it."""

from __future__ import annotations

from prometheus_client import generate_latest

from adapters.base import RequestCounts
from publisher import metrics
from publisher.core.values import Backend, MapKey, Route
from publisher.split.check import SplitVerifier
from tests.loop_turns import loop_turns
from tests.builders import make_map
from tests.test_loop import CHAT, make_publisher, put_map


class ScriptedCounter:
    """A gateway's request counter whose reports the test hands over."""

    def __init__(self) -> None:
        self.interval: float | None = None
        self.pending: list[RequestCounts] = []

    def enable(self, interval: float) -> None:
        self.interval = interval

    async def collect(self) -> list[RequestCounts]:
        pending, self.pending = self.pending, []
        return pending


def served(route: Route, shares: dict[str, float], n: int) -> dict[MapKey, dict[str, int]]:
    return {CHAT: {b.cluster: round(shares[b.cluster] * n) for b in route.backends}}


async def published_chat():
    publisher, stores, gateway = make_publisher()
    changed: list[MapKey] = []
    verifier = SplitVerifier(ScriptedCounter(), 60.0, "memory", lambda key: (changed.append(key), publisher.split_changed(key)))
    verifier.clock = lambda: 0.0  # routes confirmed at 0 s: intervals that begin from 1 s count
    publisher.split = verifier
    publisher.outbox.sink = object()  # reports are kept (no status writer runs here)
    put_map(stores, make_map())
    await publisher.sync_once({CHAT: None})
    return publisher, verifier, changed, gateway.held[CHAT]


async def test_a_correct_split_is_verified_and_a_skewed_one_named_in_the_condition_but_never_held():
    publisher, verifier, changed, route = await published_chat()
    assert [b.weight for b in route.backends] == [2, 3]
    right = {"worker-a": 0.4, "worker-b": 0.6}
    await verifier.fold([RequestCounts("gw-1", restarted=True)], 0.0)
    await verifier.fold([RequestCounts("gw-1", served(route, right, 500))], 1.0)  # the first interval is skipped
    for t in (2.0, 3.0):
        await verifier.fold([RequestCounts("gw-1", served(route, right, 2000))], t)
    assert verifier.debug(CHAT)["instances"]["gw-1"]["verdict"] == "verified"
    assert verifier.map_states == {"verified": 1}

    skewed = {"worker-a": 0.5, "worker-b": 0.5}
    await verifier.fold([RequestCounts("gw-1", served(route, skewed, 2000))], 4.0)
    assert changed == [] and verifier.note(CHAT) is None  # one off window is not enough
    await verifier.fold([RequestCounts("gw-1", served(route, skewed, 2000))], 5.0)
    assert changed == [CHAT]
    await publisher.sync_once(publisher.queue.take_ready())
    report = publisher.outbox.verdicts[CHAT]
    assert report.published and report.reason == "Published"
    assert report.message.endswith("served split on memory gw-1 over 2,000 requests: worker-a 50%, worker-b 50% (weights 2/3)")
    assert publisher.states[CHAT].state == "published"
    window = next(m for m in publisher.debug_maps() if m["name"] == "chat")["split"]["instances"]["gw-1"]
    assert window["verdict"] == "off" and window["observed"] == {"worker-a": 0.5, "worker-b": 0.5}
    assert window["expected"] == {"worker-a": 0.4, "worker-b": 0.6} and window["largestDeviation"] == 0.1

    metrics.watch_split(verifier)
    try:
        scrape = generate_latest(metrics.REGISTRY).decode()
        assert 'ome_gateway_publisher_split_off{gateway="gw-1",name="chat",namespace="prod"} 1.0' in scrape
        assert 'ome_gateway_publisher_split_maps{state="off"} 1.0' in scrape
        # One fine window clears it (issue 27: it took two, 28 minutes on a quiet map).
        await verifier.fold([RequestCounts("gw-1", served(route, right, 2000))], 6.0)
        assert changed == [CHAT, CHAT] and verifier.note(CHAT) is None
        scrape = generate_latest(metrics.REGISTRY).decode()
        assert "split_off{" not in scrape
        assert 'ome_gateway_publisher_split_counts_total{gateway="gw-1"} 6.0' in scrape
        assert 'ome_gateway_publisher_split_reports_total{gateway="gw-1"} 6.0' in scrape  # the old name, one release
    finally:
        metrics.watch_split(None)
    await publisher.sync_once(publisher.queue.take_ready())
    assert "served split" not in publisher.outbox.verdicts[CHAT].message


async def test_a_confirmed_weight_change_restarts_the_windows():
    publisher, verifier, changed, route = await published_chat()
    await verifier.fold([RequestCounts("gw-1", restarted=True)], 0.0)
    await verifier.fold([RequestCounts("gw-1", served(route, {"worker-a": 0.4, "worker-b": 0.6}, 100))], 1.0)
    await verifier.fold([RequestCounts("gw-1", served(route, {"worker-a": 0.4, "worker-b": 0.6}, 1500))], 2.0)
    assert verifier.debug(CHAT)["instances"]["gw-1"]["counting"] == 1500
    moved = Route(route.hostname, (Backend("worker-a", route.backends[0].endpoint, 1), Backend("worker-b", route.backends[1].endpoint, 1)))
    verifier.route_confirmed(CHAT, moved)
    assert verifier.debug(CHAT)["instances"]["gw-1"]["counting"] == 0


async def test_an_instance_that_leaves_is_forgotten_and_a_withdrawn_map_loses_its_note():
    publisher, verifier, changed, route = await published_chat()
    skewed = {"worker-a": 0.9, "worker-b": 0.1}
    await verifier.fold([RequestCounts("gw-1", restarted=True), RequestCounts("gw-2", restarted=True)], 0.0)
    for t in (1.0, 2.0, 3.0):
        await verifier.fold([RequestCounts("gw-1", served(route, skewed, 2000))], t)
    assert verifier.note(CHAT) is not None
    await verifier.fold([RequestCounts("gw-2", left=True)], 4.0)
    assert sorted(verifier.debug(CHAT)["instances"]) == ["gw-1"]
    verifier.route_confirmed(CHAT, None)
    assert verifier.note(CHAT) is None and changed == [CHAT, CHAT]


async def test_a_gateway_that_counts_nothing_says_so_in_debug_maps():
    publisher, stores, gateway = make_publisher()
    put_map(stores, make_map())
    await publisher.sync_once({CHAT: None})
    (entry,) = publisher.debug_maps()
    assert entry["split"] == {"gateway": "memory", "verdict": "unsupported", "detail": "the memory gateway reports no request counts"}


async def test_a_fold_of_many_busy_maps_gives_the_event_loop_back_between_slices():
    # At 10,000 busy maps one fold (adding, judging every map, counting states) held the event
    # loop 160 ms, and every weight change of that moment waited behind it.
    verifier = SplitVerifier(None, 60.0, "nginx", lambda key: None)  # type: ignore[arg-type]
    verifier.clock = lambda: 0.0
    backends = tuple(Backend(f"worker-{b}", "http://10.0.0.1:8000", 1) for b in range(2))
    keys = [MapKey("prod", f"model-{i}") for i in range(2000)]
    for i, key in enumerate(keys):
        verifier.route_confirmed(key, Route(f"model-{i}.example.com", backends))
    async with loop_turns() as turns:
        for t in (1.0, 2.0):  # the first interval after a route is skipped; the second is judged
            turns(reset=True)
            await verifier.fold([RequestCounts("gw-1", {key: {"worker-0": 1000 + i % 7, "worker-1": 1000} for i, key in enumerate(keys)})], t)
            assert turns() >= 4, f"the fold at {t} let other tasks run {turns()} times"
    assert verifier.map_states["verified"] == len(keys)


async def test_an_instance_that_leaves_takes_its_report_series_with_it():
    """Issue 27: `split_reports_total{gateway}` kept a series for every instance label ever seen:
    100 reconnects of two Envoys sharing a node id and host made 100 series."""
    verifier = SplitVerifier(ScriptedCounter(), 60.0, "envoy", lambda key: None)
    metrics.watch_split(verifier)
    try:
        for n in range(100):
            label = f"gw@10.0.0.1:{40000 + n}"
            await verifier.fold([RequestCounts(label, restarted=True), RequestCounts(label, {})], float(n))
            await verifier.fold([RequestCounts(label, left=True)], n + 0.5)
        await verifier.fold([RequestCounts("gw", restarted=True), RequestCounts("gw", {})], 200.0)
        scrape = generate_latest(metrics.REGISTRY).decode()
    finally:
        metrics.watch_split(None)
    assert scrape.count("ome_gateway_publisher_split_counts_total{") == 1 and scrape.count("ome_gateway_publisher_split_reports_total{") == 1
    assert 'ome_gateway_publisher_split_counts_total{gateway="gw"} 1.0' in scrape
    assert verifier.instances == {"gw"}


async def test_a_map_whose_counter_went_down_restarts_alone():
    """Issue 27: one evicted counter restarted every map of the NGINX instance, so with a small
    dict no map was ever judged. Only the maps named `recounted` start over."""
    verifier = SplitVerifier(ScriptedCounter(), 60.0, "nginx", lambda key: None)
    verifier.clock = lambda: 0.0
    backends = tuple(Backend(f"worker-{b}", "http://10.0.0.1:8000", 1) for b in range(2))
    keys = [MapKey("prod", f"model-{i}") for i in range(3)]
    for i, key in enumerate(keys):
        verifier.route_confirmed(key, Route(f"model-{i}.example.com", backends))
    even = {key: {"worker-0": 1000, "worker-1": 1000} for key in keys}
    await verifier.fold([RequestCounts("nginx-1", restarted=True)], 0.0)
    await verifier.fold([RequestCounts("nginx-1", {key: {"worker-0": 500} for key in keys})], 10.0)
    await verifier.fold([RequestCounts("nginx-1", {keys[0]: {"worker-0": 700}})], 15.0)
    await verifier.fold([RequestCounts("nginx-1", {k: v for k, v in even.items() if k != keys[0]}, recounted=frozenset({keys[0]}))], 20.0)
    assert [verifier.windows.state(key, "nginx-1")[0] for key in keys] == ["few_requests", "verified", "verified"]
    assert verifier.windows.state(keys[0], "nginx-1")[2] == 0  # its 700 were dropped with its count
    await verifier.fold([RequestCounts("nginx-1", even)], 30.0)
    assert [verifier.windows.state(key, "nginx-1")[0] for key in keys] == ["verified"] * 3
