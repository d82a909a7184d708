"""The loop against the fake API server over real HTTP: kube source, JSON adapter, status."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from adapters import ADAPTERS
from adapters.json import JsonOptions
from publisher import loop, status
from publisher.kube import Kube
from publisher.loop import LeaderOptions, LoopOptions, Publisher
from publisher.core.values import MapKey
from publisher.source.informer import WatchOptions
from publisher.source.kube_source import KubeSource
from publisher.source.store import Stores
from tests.builders import make_condition, make_entry, make_isvc, make_map
from tests.fakes.kube_api import FakeKubeAPI
from tests.gateways import eventually

TM = "ome.io/v1beta1/trafficmaps"
ISVC = "ome.io/v1beta1/inferenceservices"
CONDITION = "gateway-publisher.ome.io/eu"


def published(path: Path) -> dict[str, list[int]]:
    if not path.exists():
        return {}
    return {p["name"]: [b["weight"] for b in p["backends"]] for p in json.loads(path.read_text())["publications"]}


def ours(api: FakeKubeAPI, name: str = "chat") -> dict:
    """This instance's condition on the map, or an empty dict."""
    conditions = api.get(TM, "prod", name)["status"].get("conditions", [])
    return next((c for c in conditions if c["type"] == CONDITION), {})


def seed(api: FakeKubeAPI, name: str = "chat", **map_overrides) -> dict:
    """An InferenceService and its map, consistent with what the server assigned (uid, generation 1)."""
    isvc = api.create(make_isvc(name))
    return api.create(make_map(name, generation=1, isvc_uid=isvc["metadata"]["uid"],
                               observed_isvc_generation=isvc["metadata"]["generation"], **map_overrides))


def bump_routable(obj: dict) -> dict:
    """OME's routing controller answers a spec change with a current Routable condition."""
    generation = obj["metadata"]["generation"] + 1
    obj["status"]["conditions"] = [c for c in obj["status"].get("conditions", []) if c["type"] != "Routable"] + [
        make_condition("Routable", observed_generation=generation)
    ]
    return obj


def rescale(api: FakeKubeAPI, name: str, ready_b: int) -> None:
    """worker-b scales to `ready_b` replicas: OME rewrites the weights, and the map's generation
    moves (the server bumps it for the spec change) with its Routable condition."""
    current = api.get(TM, "prod", name)
    isvc = api.get(ISVC, "prod", name)
    generation = current["metadata"]["generation"] + 1
    weight_a, weight_b = (2, 3) if ready_b == 2 else (4, 3 * ready_b)
    from math import gcd

    g = gcd(weight_a, weight_b) if ready_b else weight_a
    entries = [
        make_entry("worker-a", allocated=4, ready=4, weight=weight_a // g if ready_b else 1, service=name),
        make_entry("worker-b", allocated=ready_b, ready=ready_b, factor="3", weight=weight_b // g if ready_b else 0,
                   healthy=ready_b > 0, service=name),
    ]
    fresh = make_map(name, generation=generation, entries=entries, observed_isvc_generation=isvc["metadata"]["generation"])
    current["spec"] = fresh["spec"]
    api.update(bump_routable(current))


@contextlib.asynccontextmanager
async def running(kubeconfig: Path, out: Path, *, instance: str = "eu", leader: LeaderOptions | None = None,
                  report_status: bool = True, watch: WatchOptions | None = None) -> AsyncIterator[Publisher]:
    kube = await Kube.connect(kubeconfig)
    stores = Stores.empty()
    sink = status.ConditionSink(kube, stores.maps, instance) if report_status else None
    publisher = Publisher(stores, ADAPTERS["json"].engine("json", JsonOptions(json_path=out)),
                          LoopOptions(region=instance, resync=3600), status_sink=sink)
    # Short backoff: the fake answers at once, and tests wait on reconnects.
    watch = watch or WatchOptions(backoff_initial=0.05, backoff_max=0.5, silence_timeout=5, region=instance)
    source = KubeSource(kube, stores, publisher, watch, clock=publisher.clock)
    task = asyncio.create_task(loop.run(publisher, source, leader=leader, kube=kube))
    try:
        await eventually(lambda: publisher.is_synced or task.done())
        if task.done():
            task.result()  # the loop stopped: show why
        yield publisher
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await kube.close()


async def test_map_change_reaches_the_json_file(kube_api, kubeconfig, tmp_path):
    seed(kube_api)
    out = tmp_path / "out.json"
    async with running(kubeconfig, out):
        await eventually(lambda: published(out) == {"chat": [2, 3]})
        rescale(kube_api, "chat", 4)
        await eventually(lambda: published(out) == {"chat": [1, 3]})


async def test_held_map_keeps_its_publication_while_others_move(kube_api, kubeconfig, tmp_path):
    seed(kube_api)
    seed(kube_api, "embed", entries=[make_entry("worker-a", service="embed")])
    out = tmp_path / "out.json"
    async with running(kubeconfig, out) as publisher:
        await eventually(lambda: published(out) == {"chat": [2, 3], "embed": [1]})
        bad = kube_api.get(TM, "prod", "chat")
        bad["spec"]["entries"][0]["weight"] = 7  # no longer what the replicas give
        kube_api.update(bump_routable(bad))
        embed = kube_api.get(TM, "prod", "embed")
        embed["spec"]["entries"].append(make_entry("worker-b", service="embed"))
        kube_api.update(bump_routable(embed))
        await eventually(lambda: published(out) == {"chat": [2, 3], "embed": [1, 1]})
        await eventually(lambda: ours(kube_api).get("reason") == "VerificationFailed")
        assert publisher.states[("prod", "chat")].state == "held"


def lists(api: FakeKubeAPI) -> int:
    return api.count("list", path="/apis/ome.io/v1beta1/trafficmaps")


async def test_a_dropped_connection_loses_no_update(kube_api, kubeconfig, tmp_path):
    seed(kube_api)
    out = tmp_path / "out.json"
    async with running(kubeconfig, out, report_status=False):
        await eventually(lambda: published(out) == {"chat": [2, 3]})
        kube_api.drop_watches()
        rescale(kube_api, "chat", 4)
        await eventually(lambda: published(out) == {"chat": [1, 3]})
    assert lists(kube_api) == 1  # resumed from its version, no relist


@pytest.mark.parametrize("as_http", [False, True], ids=["error-event", "http-410"])
async def test_gone_mid_watch_relists_and_loses_no_update_or_deletion(kube_api, kubeconfig, tmp_path, as_http):
    kube_api.expired_watch_as_http = as_http  # a real server sends an ERROR event; some answer HTTP 410
    kube_api.bookmark_interval = None  # the watch's version stays at its last event
    seed(kube_api)
    seed(kube_api, "embed", entries=[make_entry("worker-a", service="embed")])
    out = tmp_path / "out.json"
    async with running(kubeconfig, out, report_status=False):
        await eventually(lambda: published(out) == {"chat": [2, 3], "embed": [1]})
        # While no watch is connected: a change and a deletion, then the history expires.
        kube_api.drop_watches()
        rescale(kube_api, "chat", 4)
        kube_api.delete(TM, "prod", "embed")
        kube_api.expire_history()
        await eventually(lambda: published(out) == {"chat": [1, 3]})
    assert lists(kube_api) >= 2


async def test_silent_change_is_found_by_the_relist_after_410(kube_api, kubeconfig, tmp_path):
    kube_api.bookmark_interval = None
    seed(kube_api)
    out = tmp_path / "out.json"
    async with running(kubeconfig, out, report_status=False):
        await eventually(lambda: published(out) == {"chat": [2, 3]})
        current = kube_api.get(TM, "prod", "chat")
        current["metadata"]["deletionTimestamp"] = "2026-11-30T00:00:00Z"
        kube_api.change_silently(current)
        kube_api.expire_history()
        kube_api.drop_watches()
        await eventually(lambda: published(out) == {})
    assert lists(kube_api) >= 2


async def test_isvc_generation_ahead_holds_the_map_until_it_catches_up(kube_api, kubeconfig, tmp_path):
    seed(kube_api)
    out = tmp_path / "out.json"
    async with running(kubeconfig, out) as publisher:
        await eventually(lambda: published(out) == {"chat": [2, 3]})
        isvc = kube_api.get(ISVC, "prod", "chat")
        isvc["spec"]["routing"] = {"capacityFactors": {"worker-b": "6"}}
        kube_api.update(isvc)
        # .get: the map's state may not be recorded yet when the first poll runs.
        await eventually(lambda: getattr(publisher.states.get(("prod", "chat")), "reason", None) == "ISVCGenerationMismatch")
        assert published(out) == {"chat": [2, 3]}
        tm = bump_routable(kube_api.get(TM, "prod", "chat"))
        tm["spec"]["observedISVCGeneration"] = 2
        tm["spec"]["entries"][1]["capacity"]["factor"] = "6"
        tm["spec"]["entries"][0]["weight"], tm["spec"]["entries"][1]["weight"] = 1, 3
        kube_api.update(tm)
        await eventually(lambda: published(out) == {"chat": [1, 3]})


async def test_status_condition_is_ours_alone_and_not_rewritten(kube_api, kubeconfig, tmp_path):
    seed(kube_api, published=make_condition("Published", observed_generation=1), observed_traffic_map_generation=1)
    out = tmp_path / "out.json"

    async with running(kubeconfig, out):
        condition = await eventually(lambda: ours(kube_api))
    assert condition["status"] == "True" and condition["reason"] == "Published" and condition["observedGeneration"] == 1
    stored = kube_api.get(TM, "prod", "chat")
    assert {c["type"] for c in stored["status"]["conditions"]} == {"Routable", "Published", CONDITION}
    assert stored["status"]["observedTrafficMapGeneration"] == 1 and stored["status"]["sourceUID"]
    writes = kube_api.count("patch", field_manager="ome-gateway-publisher-eu")
    assert writes == 1
    async with running(kubeconfig, out) as publisher:
        await eventually(lambda: publisher.states.get(("prod", "chat")) and publisher.states[("prod", "chat")].state == "published")
        await asyncio.sleep(0.2)
    assert kube_api.count("patch", field_manager="ome-gateway-publisher-eu") == writes


async def test_of_two_leader_elected_replicas_only_one_writes_status(kube_api, kubeconfig, tmp_path):
    seed(kube_api)
    fast = dict(lease_duration=4, renew_deadline=3, retry_period=1)
    async with running(kubeconfig, tmp_path / "a.json", leader=LeaderOptions("prod", "replica-a", **fast)) as a, \
            running(kubeconfig, tmp_path / "b.json", leader=LeaderOptions("prod", "replica-b", **fast)) as b:
        await eventually(lambda: published(tmp_path / "a.json") and published(tmp_path / "b.json"))
        await eventually(lambda: a.outbox.leading or b.outbox.leading)
        await eventually(lambda: kube_api.count("patch", field_manager="ome-gateway-publisher-eu") >= 1)
        rescale(kube_api, "chat", 4)
        await eventually(lambda: published(tmp_path / "a.json") == {"chat": [1, 3]} == published(tmp_path / "b.json"))
        await eventually(lambda: ours(kube_api).get("observedGeneration") == 2)
        assert a.outbox.leading != b.outbox.leading
    assert kube_api.get("coordination.k8s.io/v1/leases", "prod", "ome-gateway-publisher-eu") is not None


async def test_burst_of_100_changes_ends_in_the_last_state(kube_api, kubeconfig, tmp_path):
    seed(kube_api)
    out = tmp_path / "out.json"
    async with running(kubeconfig, out, report_status=False):
        await eventually(lambda: published(out) == {"chat": [2, 3]})
        for i in range(100):
            rescale(kube_api, "chat", 1 + i % 4)
            if i % 10 == 0:
                await asyncio.sleep(0)
        # The last change set worker-b to 4 replicas: 4 x 1 : 4 x 3 = 1 : 3.
        await eventually(lambda: published(out) == {"chat": [1, 3]})


async def test_a_silent_watch_is_reopened(kube_api, kubeconfig, tmp_path):
    kube_api.bookmark_interval = None
    seed(kube_api)
    silent = WatchOptions(silence_timeout=0.2, backoff_initial=0.01, backoff_max=0.05)
    async with running(kubeconfig, tmp_path / "out.json", report_status=False, watch=silent):
        await eventually(lambda: kube_api.count("watch", path="/apis/ome.io/v1beta1/trafficmaps") >= 3)


async def test_server_errors_at_start_are_retried(kube_api, kubeconfig, tmp_path):
    seed(kube_api)
    kube_api.fail_next(3, 500, verb="list")
    out = tmp_path / "out.json"
    async with running(kubeconfig, out, report_status=False):
        await eventually(lambda: published(out) == {"chat": [2, 3]})


async def test_another_regions_condition_is_noted_not_decided(kube_api, kubeconfig, tmp_path):
    # Issue 20, finding 3: every region's status write reached every other region's loop as a
    # change, to be parsed, validated and decided again: O(R) work per change per sidecar.
    seed(kube_api)
    out = tmp_path / "out.json"
    async with running(kubeconfig, out, report_status=False) as publisher:
        await eventually(lambda: published(out) == {"chat": [2, 3]})
        kube = await Kube.connect(kubeconfig)
        try:
            def condition(region: str) -> dict:
                return {"type": f"gateway-publisher.ome.io/{region}", "status": "True", "reason": "Published", "message": region,
                        "observedGeneration": 1, "lastTransitionTime": "2026-11-30T12:00:00Z"}

            changed: list = []
            passed_on = publisher.changed
            publisher.changed = lambda keys, *, at: (changed.extend(keys), passed_on(keys, at=at))
            first = await status.write_condition(kube, MapKey("prod", "chat"), condition("ap"), "ap")
            await eventually(lambda: publisher.stores.maps.version(MapKey("prod", "chat")) == first)
            version = await status.write_condition(kube, MapKey("prod", "chat"), condition("us"), "us")
        finally:
            await kube.close()
        # The event arrived: the Store holds the map's new version, with the object it had.
        await eventually(lambda: publisher.stores.maps.version(MapKey("prod", "chat")) == version)
        rescale(kube_api, "chat", 4)
        await eventually(lambda: published(out) == {"chat": [1, 3]})
        assert changed == [("prod", "chat")]  # the rescale alone


async def test_our_condition_coming_back_is_compared_not_decided_and_written_again_when_edited(kube_api, kubeconfig, tmp_path):
    # Issue 29: the echo of every condition the sidecar wrote woke the applier to decide, apply
    # and settle the map again (10,000 passes at start at 10,000 maps, then one a change), though
    # no decision reads our own condition. It is the status writer's alone to compare.
    seed(kube_api, published=make_condition("Published", observed_generation=1), observed_traffic_map_generation=1)
    out = tmp_path / "out.json"
    async with running(kubeconfig, out) as publisher:
        written = await eventually(lambda: ours(kube_api))
        await eventually(lambda: status.own_condition(publisher.stores.maps.get(MapKey("prod", "chat")), "eu") is not None)
        changed: list = []
        passed_on = publisher.changed
        publisher.changed = lambda keys, *, at: (changed.extend(keys), passed_on(keys, at=at))
        edited = kube_api.get(TM, "prod", "chat")
        next(c for c in edited["status"]["conditions"] if c["type"] == CONDITION)["message"] = "edited by hand"
        kube_api.update(edited)
        repaired = await eventually(lambda: (c := ours(kube_api)).get("message", "edited by hand") != "edited by hand" and c)
        await eventually(lambda: publisher.stores.maps.version(MapKey("prod", "chat")) == kube_api.get(TM, "prod", "chat")["metadata"]["resourceVersion"])
        assert repaired == written
        assert changed == []


async def test_each_request_carries_the_token_the_configuration_holds_at_that_moment(kube_api, kubeconfig):
    # Requests go on kubernetes_asyncio's session but not through its call_api (whose generic
    # serialisation was most of what a status write cost over a bare client): the token must still be the
    # configuration's of the moment, as its refresh hook rotates in-cluster and exec tokens.
    from publisher.kube import TRAFFIC_MAPS

    seed(kube_api)
    kube = await Kube.connect(kubeconfig)
    tokens = iter(["first", "second", "third"])

    def rotate(configuration) -> None:
        configuration.api_key["BearerToken"] = f"Bearer {next(tokens)}"

    kube.api_client.configuration.refresh_api_key_hook = rotate
    try:
        assert (await kube.get(TRAFFIC_MAPS, "prod", "chat"))["metadata"]["name"] == "chat"
        listed = await kube.list(TRAFFIC_MAPS, namespace="prod", label_selector="app notin (other,more)", limit=1)
        applied = await status.write_condition(kube, MapKey("prod", "chat"), make_condition(CONDITION, reason="Published"), "eu")
    finally:
        await kube.close()
    assert [item["metadata"]["name"] for item in listed["items"]] == ["chat"]
    assert applied == kube_api.get(TM, "prod", "chat")["metadata"]["resourceVersion"]
    assert [(r.verb, r.token) for r in kube_api.requests[-3:]] == [("get", "first"), ("list", "second"), ("patch", "third")]
    assert kube_api.requests[-1].content_type == "application/apply-patch+yaml" and kube_api.requests[-1].field_manager == "ome-gateway-publisher-eu"
