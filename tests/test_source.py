from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import time
from pathlib import Path

import pytest
import yaml

from publisher.core.model import InvalidObject, TrafficMap, parse_traffic_map
from publisher.core.values import MapKey
from publisher.source.directory import DirectorySource
from publisher.source.objects import map_digest
from publisher.source.store import MapStore, Store, Stores
from publisher.source.watch import Bookmark, Event, Relist, WatchError, WatchState
from tests.builders import make_condition, make_isvc, make_map

CHAT = MapKey("prod", "chat")


# --- WatchState: the watch protocol as plain strings ---------------------------------------------


def line(kind: str, obj: dict) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode()


def test_watch_state_tracks_the_version_of_each_event():
    state = WatchState("10")
    item = state.feed(line("MODIFIED", make_map(resource_version="11")))
    assert isinstance(item, Event) and item.type == "MODIFIED"
    assert state.resource_version == "11"


def test_bookmark_moves_the_version_without_an_object():
    state = WatchState("10")
    assert state.feed(line("BOOKMARK", {"kind": "TrafficMap", "metadata": {"resourceVersion": "42"}})) == Bookmark("42")
    assert state.resource_version == "42"


def test_gone_error_event_asks_for_a_relist():
    state = WatchState("10")
    status = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old resource version"}
    assert state.feed(line("ERROR", status)) == Relist("Expired")
    assert state.resource_version == "10"


@pytest.mark.parametrize(
    "raw",
    [b"not json", json.dumps({"type": "ERROR", "object": {"code": 500, "message": "boom"}}).encode(), line("SURPRISE", {})],
    ids=["undecodable", "error-500", "unknown-type"],
)
def test_other_watch_failures_raise(raw):
    with pytest.raises(WatchError):
        WatchState("1").feed(raw)


def test_blank_lines_are_ignored():
    assert WatchState("1").feed(b"  \n") is None


# --- Store ------------------------------------------------------------------------------------------


def test_upsert_of_the_same_version_is_no_change():
    store: Store[str] = Store()
    assert store.upsert(CHAT, "a", "1")
    assert not store.upsert(CHAT, "a", "1")
    assert store.upsert(CHAT, "b", "2")


def test_replace_yields_vanished_keys_within_its_namespace():
    store: Store[str] = Store()
    other = MapKey("dev", "x")
    store.upsert(CHAT, "a", "1")
    store.upsert(MapKey("prod", "gone"), "a", "1")
    store.upsert(other, "a", "1")
    changed = store.replace([(CHAT, "a", "1")], namespace="prod")
    assert changed == {MapKey("prod", "gone")}
    assert store.get(other) == "a"


def test_the_map_store_indexes_each_map_by_its_service_and_an_unmoved_map_makes_nothing_new():
    """The index follows a map that names another InferenceService; an event that keeps the
    service (nearly all: an echo of our condition, new entries) leaves the index as it was, not
    a new set and keys for the collector to walk (two keys and a set per echo at a start)."""
    store = MapStore()
    store.upsert(CHAT, parse_traffic_map(make_map()), "1")
    store.upsert(MapKey("prod", "other"), parse_traffic_map(make_map("other")), "1")
    chat_service = MapKey("prod", "chat")
    assert store.naming(chat_service) == {CHAT}
    moved = make_map()
    moved["spec"]["service"] = "other"
    store.upsert(CHAT, parse_traffic_map(moved), "2")
    assert store.naming(chat_service) == frozenset()
    assert store.naming(MapKey("prod", "other")) == {CHAT, MapKey("prod", "other")}
    store.upsert(CHAT, parse_traffic_map(make_map()), "3")
    assert store.naming(chat_service) == {CHAT} and store.naming(MapKey("prod", "other")) == {MapKey("prod", "other")}
    stays = parse_traffic_map(make_map(resource_version="4"))
    key = MapKey("prod", "chat")  # equal to CHAT, as an event's key is, but another object
    gc.collect()
    gc.disable()
    try:
        store.upsert(key, stays, "4")
        young = gc.get_objects(generation=0)
    finally:
        gc.enable()
    assert store.get(CHAT) is stays and store.naming(chat_service) == {CHAT}
    assert not [obj for obj in young if type(obj) in (set, MapKey)]


# --- DirectorySource --------------------------------------------------------------------------------


class Sink:
    def __init__(self) -> None:
        self.keys: set[MapKey] = set()
        self.reported_keys: list[MapKey] = []
        self.synced_count = 0

    def changed(self, keys, *, at: float) -> None:
        self.keys |= set(keys)

    def reported(self, keys) -> None:
        self.reported_keys.extend(keys)

    def synced(self) -> None:
        self.synced_count += 1


def write(path: Path, *objects: dict) -> None:
    path.write_text(yaml.safe_dump_all(objects))


async def test_directory_source_reads_maps_and_isvcs(tmp_path):
    write(tmp_path / "chat.yaml", make_isvc(), make_map())
    stores, sink = Stores.empty(), Sink()
    source = DirectorySource(tmp_path, stores, sink, clock=lambda: 0.0)
    await source.scan()
    assert isinstance(stores.maps.get(CHAT), TrafficMap)
    assert stores.isvcs.get(CHAT) is not None
    assert sink.keys == {CHAT}


async def test_rewriting_a_file_with_the_same_objects_changes_nothing(tmp_path):
    write(tmp_path / "chat.yaml", make_isvc(), make_map())
    stores, sink = Stores.empty(), Sink()
    source = DirectorySource(tmp_path, stores, sink, clock=lambda: 0.0)
    await source.scan()
    sink.keys.clear()
    (tmp_path / "chat.yaml").write_text("# touched\n" + (tmp_path / "chat.yaml").read_text())
    await source.scan()
    assert sink.keys == set()


async def test_bad_file_is_skipped_and_its_maps_keep_their_last_state(tmp_path):
    write(tmp_path / "chat.yaml", make_isvc(), make_map())
    write(tmp_path / "embed.yaml", make_isvc("embed"), make_map("embed"))
    stores, sink = Stores.empty(), Sink()
    source = DirectorySource(tmp_path, stores, sink, clock=lambda: 0.0)
    await source.scan()
    (tmp_path / "chat.yaml").write_text("metadata: [unclosed\n")
    write(tmp_path / "embed.yaml", make_isvc("embed"), make_map("embed", generation=5))
    sink.keys.clear()
    await source.scan()
    assert sink.keys == {MapKey("prod", "embed")}
    assert isinstance(stores.maps.get(CHAT), TrafficMap)
    assert stores.maps.get(MapKey("prod", "embed")).metadata.generation == 5


async def test_removed_file_removes_its_objects(tmp_path):
    write(tmp_path / "chat.yaml", make_isvc(), make_map())
    stores, sink = Stores.empty(), Sink()
    source = DirectorySource(tmp_path, stores, sink, clock=lambda: 0.0)
    await source.scan()
    (tmp_path / "chat.yaml").unlink()
    await source.scan()
    assert stores.maps.get(CHAT) is None


async def test_invalid_map_is_stored_as_invalid_object(tmp_path):
    write(tmp_path / "chat.yaml", make_map(spec={"entries": [{"cluster": "a;b", "endpoint": "http://x", "weight": 1, "healthy": True}]}))
    stores, sink = Stores.empty(), Sink()
    await DirectorySource(tmp_path, stores, sink, clock=lambda: 0.0).scan()
    assert isinstance(stores.maps.get(CHAT), InvalidObject)


async def test_run_reports_synced_once_and_sees_changes(tmp_path):
    write(tmp_path / "chat.yaml", make_isvc(), make_map())
    stores, sink = Stores.empty(), Sink()
    source = DirectorySource(tmp_path, stores, sink, clock=lambda: 0.0, poll_interval=0.01)
    task = asyncio.create_task(source.run())
    try:
        for _ in range(500):
            await asyncio.sleep(0.01)
            if sink.synced_count:
                break
        write(tmp_path / "chat.yaml", make_isvc(), make_map(generation=9))
        for _ in range(500):
            await asyncio.sleep(0.01)
            if stores.maps.get(CHAT).metadata.generation == 9:
                break
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert sink.synced_count == 1
    assert stores.maps.get(CHAT).metadata.generation == 9


# --- ReconnectBackoff and refusals: pure ------------------------------------------------------------


def jitter_at(monkeypatch, end: str) -> None:
    """tenacity's random waits (random.uniform) always at the top or the bottom of their range."""
    monkeypatch.setattr("random.uniform", (lambda low, high: high) if end == "top" else (lambda low, high: low))


def test_backoff_doubles_up_to_its_cap_with_jitter_down_to_half(monkeypatch):
    from publisher.retry import ReconnectBackoff

    jitter_at(monkeypatch, "top")
    top = ReconnectBackoff(1.0, 8.0, 60.0)
    assert [top.failed() for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    jitter_at(monkeypatch, "bottom")
    bottom = ReconnectBackoff(1.0, 8.0, 60.0)
    assert [bottom.failed() for _ in range(3)] == [0.5, 1.0, 2.0]


def test_backoff_jitter_stays_between_half_and_the_whole_step():
    from publisher.retry import ReconnectBackoff

    backoff = ReconnectBackoff(1.0, 8.0, 60.0)
    for step in (1.0, 2.0, 4.0, 8.0, 8.0):
        assert step / 2 <= backoff.failed() <= step


def test_backoff_starts_over_only_after_a_connection_that_lasted(monkeypatch):
    from publisher.retry import ReconnectBackoff

    jitter_at(monkeypatch, "top")
    backoff = ReconnectBackoff(1.0, 64.0, 60.0)
    backoff.failed(), backoff.failed()
    backoff.connected_for(59.9)
    assert backoff.failed() == 4.0
    backoff.connected_for(60.0)
    assert backoff.failed() == 1.0


@pytest.mark.parametrize(
    ("code", "namespace", "expected"),
    [
        (401, None, "list trafficmaps.ome.io in all namespaces: 401 Unauthorized: the API server did not accept our credentials"),
        (403, "prod", 'list trafficmaps.ome.io in namespace prod: 403 Forbidden: denied; missing RBAC rule in a Role in namespace prod '
                      '(and its RoleBinding): apiGroups: ["ome.io"], resources: ["trafficmaps"], verbs: ["get", "list", "watch"]'),
        (403, None, "missing RBAC rule in a ClusterRole (and its ClusterRoleBinding)"),
        (404, None, "404 NotFound: the API server does not serve ome.io/v1beta1 trafficmaps (is OME's CustomResourceDefinition installed"),
    ],
    ids=["401", "403-namespaced", "403-cluster", "404"],
)
def test_a_refusal_names_verb_resource_scope_and_fix(code, namespace, expected):
    from publisher.kube import TRAFFIC_MAPS, KubeError
    from publisher.source.refusals import describe_refusal

    assert expected in describe_refusal(KubeError(code, "", "denied"), "list", TRAFFIC_MAPS, namespace)


# --- Issue 21, finding 8: source edges ---------------------------------------------------------------


@contextlib.asynccontextmanager
async def kube_source(kubeconfig, sink, stores=None, region=None):
    from publisher.kube import Kube
    from publisher.source.informer import WatchOptions
    from publisher.source.kube_source import KubeSource

    kube = await Kube.connect(kubeconfig)
    stores = stores or Stores.empty()
    source = KubeSource(kube, stores, sink, WatchOptions(backoff_initial=0.01, backoff_max=0.05, silence_timeout=5, region=region), clock=time.monotonic)
    task = asyncio.create_task(source.run())
    try:
        yield stores, task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await kube.close()


@pytest.mark.parametrize(
    ("verb", "body"),
    [
        ("list", b"<html><body>502 Bad Gateway</body></html>"),
        ("list", b'{"kind":"TrafficMapList","items":[{"metadata":'),
        ("list", b"[1, 2]"),
        ("list", b'{"items": "none", "metadata": {}}'),
        ("watch", b'{"type":"ADDED","object":"not an object"}\n'),
    ],
    ids=["proxy-page", "truncated", "not-an-object", "items-not-a-list", "watch-object-not-an-object"],
)
async def test_a_2xx_answer_that_is_not_what_was_asked_is_retried_and_never_ends_the_source(kube_api, kubeconfig, verb, body):
    """A 2xx body that is not JSON (a proxy's page) raised out of the informer and ended the process."""
    from tests.gateways import eventually

    kube_api.create(make_isvc())
    kube_api.create(make_map())
    kube_api.answer_next(2, body, verb=verb)
    sink = Sink()
    async with kube_source(kubeconfig, sink) as (stores, task):
        await eventually(lambda: (sink.synced_count == 1 and kube_api.count(verb) >= 3) or task.done(), timeout=10)
        assert not task.done(), task.exception()
        assert isinstance(stores.maps.get(CHAT), TrafficMap)
        sink.keys.clear()
        kube_api.update(make_map(generation=4, resource_version=""))
        await eventually(lambda: CHAT in sink.keys or task.done(), timeout=10)
        assert not task.done(), task.exception()


async def test_a_map_is_woken_by_the_inferenceservice_its_spec_names_not_by_its_own_name(kube_api, kubeconfig):
    """A map whose spec.service differs from its name saw its InferenceService's changes only at resync."""
    from tests.gateways import eventually

    llm = kube_api.create(make_isvc("llm"))
    kube_api.create(make_map(spec={"service": "llm"}))
    sink = Sink()
    async with kube_source(kubeconfig, sink) as (stores, task):
        await eventually(lambda: sink.synced_count == 1 or task.done(), timeout=10)
        sink.keys.clear()
        llm["metadata"]["annotations"] = {"changed": "yes"}
        kube_api.update(llm)
        await eventually(lambda: CHAT in sink.keys or task.done(), timeout=10)
        assert not task.done(), task.exception()


async def test_a_directory_map_is_woken_by_the_inferenceservice_it_names_until_it_names_another(tmp_path):
    write(tmp_path / "isvc.yaml", make_isvc("llm"), make_isvc("other"))
    write(tmp_path / "chat.yaml", make_map(spec={"service": "llm"}))
    stores, sink = Stores.empty(), Sink()
    source = DirectorySource(tmp_path, stores, sink, clock=lambda: 0.0)
    await source.scan()
    sink.keys.clear()
    write(tmp_path / "isvc.yaml", make_isvc("llm", generation=7), make_isvc("other"))
    await source.scan()
    assert sink.keys == {CHAT}
    write(tmp_path / "chat.yaml", make_map(spec={"service": "other"}))
    await source.scan()
    sink.keys.clear()
    write(tmp_path / "isvc.yaml", make_isvc("llm", generation=8), make_isvc("other"))
    await source.scan()
    assert sink.keys == set(), "chat names other now"
    write(tmp_path / "isvc.yaml", make_isvc("llm", generation=8), make_isvc("other", generation=9))
    await source.scan()
    assert sink.keys == {CHAT}


# --- issue 20: other regions' conditions are noted, not parsed ----------------------------------


def with_condition(raw: dict, type_: str, status: str = "True", manager: str | None = None, version: str = "9") -> dict:
    """`raw` with one more condition, the managedFields entry its writer gets and a new version."""
    out = json.loads(json.dumps(raw))
    out["status"].setdefault("conditions", []).append(make_condition(type_, status))
    out["metadata"]["resourceVersion"] = version
    out["metadata"].setdefault("managedFields", []).append({"manager": manager or type_, "operation": "Apply", "subresource": "status"})
    return out


@pytest.mark.parametrize(
    ("change", "decided", "own"),
    [
        (lambda raw: with_condition(raw, "gateway-publisher.ome.io/us", manager="ome-gateway-publisher-us"), False, False),
        (lambda raw: with_condition(raw, "gateway-publisher.ome.io/eu"), False, True),
        (lambda raw: with_condition(raw, "Published"), True, False),
        (lambda raw: make_map(generation=4, resource_version="9"), True, False),
    ],
    ids=["other-region", "own-condition", "omes-condition", "spec"],
)
def test_a_digest_sets_apart_what_is_decided_from_our_own_condition_and_ignores_other_instances(change, decided, own):
    raw = with_condition(make_map(), "gateway-publisher.ome.io/ap", manager="ome-gateway-publisher-ap", version="8")
    before, after = map_digest(raw, "gateway-publisher.ome.io/eu"), map_digest(change(raw), "gateway-publisher.ome.io/eu")
    assert (before.decided != after.decided, before.own != after.own) == (decided, own)


async def test_the_echo_of_our_own_condition_keeps_the_stored_spec(kube_api, kubeconfig):
    """Issue 29: each echo was parsed in full, a new map of some 22 objects the collector tracks;
    the start's 10,000 echoes at 10,000 maps left it 200,000 more to walk (a 250-350 ms pause)."""
    from publisher import status
    from publisher.core.model import parse_traffic_map
    from publisher.kube import Kube
    from tests.gateways import eventually

    kube_api.create(make_isvc())
    kube_api.create(make_map())
    sink = Sink()
    async with kube_source(kubeconfig, sink, region="eu") as (stores, task):
        await eventually(lambda: sink.synced_count == 1 or task.done(), timeout=10)
        before = stores.maps.get(CHAT)
        assert isinstance(before, TrafficMap)
        kube = await Kube.connect(kubeconfig)
        try:
            echo = await status.write_condition(kube, CHAT, make_condition("gateway-publisher.ome.io/eu", reason="Published"), "eu")
        finally:
            await kube.close()
        await eventually(lambda: stores.maps.version(CHAT) == echo or task.done(), timeout=10)
        item = stores.maps.get(CHAT)
        assert item == parse_traffic_map(kube_api.get("ome.io/v1beta1/trafficmaps", "prod", "chat"))
        assert isinstance(item, TrafficMap) and item.spec is before.spec and item.metadata.resource_version == echo


async def test_the_echo_of_our_own_condition_is_stored_and_reported_not_decided_again(kube_api, kubeconfig):
    """Every condition the sidecar wrote came back as a change: parsed, decided and settled again
    (10,000 passes at start, one a change after), though no decision reads our own condition."""
    from publisher import status
    from publisher.core.model import Condition, validate
    from publisher.kube import Kube
    from tests.gateways import eventually

    kube_api.create(make_isvc())
    kube_api.create(make_map())
    sink = Sink()
    async with kube_source(kubeconfig, sink, region="eu") as (stores, task):
        await eventually(lambda: sink.synced_count == 1 or task.done(), timeout=10)
        sink.keys.clear()
        revision = stores.maps.revision(CHAT)
        ours = make_condition("gateway-publisher.ome.io/eu", reason="Published", lastTransitionTime="2026-12-06T12:00:00Z")
        kube = await Kube.connect(kubeconfig)
        try:
            echo = await status.write_condition(kube, CHAT, ours, "eu")
        finally:
            await kube.close()
        await eventually(lambda: stores.maps.version(CHAT) == echo or task.done(), timeout=10)
        item = stores.maps.get(CHAT)
        assert isinstance(item, TrafficMap)
        assert item.status.condition("gateway-publisher.ome.io/eu") == validate(Condition, ours)
        assert (sink.keys, sink.reported_keys, stores.maps.revision(CHAT)) == (set(), [CHAT], revision)
        # OME's own condition is decided from: a change, and a new revision.
        omes = kube_api.get("ome.io/v1beta1/trafficmaps", "prod", "chat")
        omes["status"]["conditions"] = [c for c in omes["status"]["conditions"] if c["type"] != "Routable"]
        kube_api.update(omes)
        await eventually(lambda: CHAT in sink.keys or task.done(), timeout=10)
        assert stores.maps.revision(CHAT) != revision and sink.reported_keys == [CHAT]
