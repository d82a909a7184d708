from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from adapters import ADAPTERS
from adapters.base import Adapter, Unavailable
from adapters.httproute import (
    ALL_ZERO_NOTE,
    NOT_REPORTED_NOTE,
    HttpRouteAdapter,
    HttpRouteOptions,
    parse_route,
    render_route,
    route_name,
    route_verdict,
    service_name,
)
from publisher.kube import HTTP_ROUTES, Kube
from publisher.model import Backend, Held, MapKey, Publication, Reason
from tests.fakes.kube_api import FakeKubeAPI

ROUTES = "gateway.networking.k8s.io/v1/httproutes"
SERVICES = "v1/services"
MANAGER = "ome-gateway-publisher-eu"
PARENT = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": "gateways", "name": "global"}


def options(**overrides: Any) -> HttpRouteOptions:
    values: dict[str, Any] = {"gateway": "gateways/global", "backend_port": 8080, "name": "eu", "route_status_timeout": 5.0}
    return HttpRouteOptions(**{**values, **overrides})


def pub(name: str, *weights: int, namespace: str = "prod", generation: int = 2) -> Publication:
    backends = tuple(Backend(f"worker-{i}", f"http://{name}.worker-{i}.example.com", w) for i, w in enumerate(weights))
    return Publication(namespace, name, f"{name}.example.com", generation, 6, backends)


def by_key(*pubs: Publication) -> dict[MapKey, Publication]:
    return {p.key: p for p in pubs}


Verdict = Callable[[dict[str, Any]], tuple[str, str, str]]  # route -> (ResolvedRefs status, reason, message)


def accept_all(route: dict[str, Any]) -> tuple[str, str, str]:
    return "True", "ResolvedRefs", "resolved"


@contextlib.asynccontextmanager
async def gateway_controller(api: FakeKubeAPI, verdict: Verdict = accept_all) -> AsyncIterator[None]:
    """Plays the gateway's controller: reports on each generation of every route attached to it."""

    async def run() -> None:
        while True:
            for route in api.objects(ROUTES):
                if route["spec"].get("parentRefs") != [PARENT]:
                    continue
                generation = route["metadata"]["generation"]
                parents = (route.get("status") or {}).get("parents") or []
                if parents and parents[0]["conditions"][0]["observedGeneration"] == generation:
                    continue
                status, reason, message = verdict(route)
                conditions = [
                    {"type": "Accepted", "status": "True", "reason": "Accepted", "message": "", "observedGeneration": generation},
                    {"type": "ResolvedRefs", "status": status, "reason": reason, "message": message, "observedGeneration": generation},
                ]
                route["status"] = {"parents": [{"parentRef": PARENT, "controllerName": "example.com/gateway", "conditions": conditions}]}
                api.update(route)
            await asyncio.sleep(0.01)

    task = asyncio.create_task(run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.fixture
async def kube(kubeconfig) -> AsyncIterator[Kube]:
    connected = await Kube.connect(kubeconfig)
    yield connected
    await connected.close()


@pytest.fixture
async def adapter(kube: Kube) -> AsyncIterator[HttpRouteAdapter]:
    started = HttpRouteAdapter(options(), kube)
    assert await started.current() == {}
    yield started
    await started.aclose()


def writes(api: FakeKubeAPI, since: int = 0) -> list[tuple[str, str]]:
    return [(r.verb, r.path.rsplit("/", 2)[-2] + "/" + r.path.rsplit("/", 1)[-1]) for r in api.requests[since:] if r.verb in ("patch", "delete", "create", "update")]


# --- creating and changing a route -------------------------------------------------------------


async def test_a_publication_becomes_a_route_and_external_name_services(kube_api: FakeKubeAPI, adapter: HttpRouteAdapter) -> None:
    chat = pub("chat", 3, 1, 0)
    async with gateway_controller(kube_api):
        result = await adapter.apply(by_key(chat), frozenset({chat.key}))
    assert result.wrote and not result.rejected and not result.notes
    route = kube_api.get(ROUTES, "prod", "chat-eu")
    assert route is not None
    assert route["spec"]["parentRefs"] == [PARENT]
    assert route["spec"]["hostnames"] == ["chat.example.com"]
    [rule] = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    assert [(ref["name"], ref["port"], ref["weight"]) for ref in rule["backendRefs"]] == [
        (service_name(chat.key, f"worker-{i}", "eu"), 8080, w) for i, w in enumerate((3, 1, 0))
    ]
    assert route["metadata"]["labels"] == {
        "app.kubernetes.io/managed-by": "ome-gateway-publisher",
        "gateway-publisher.ome.io/instance": "eu",
        "gateway-publisher.ome.io/source-namespace": "prod",
        "gateway-publisher.ome.io/source-name": "chat",
    }
    for i, ref in enumerate(rule["backendRefs"]):
        service = kube_api.get(SERVICES, "prod", ref["name"])
        assert service is not None
        assert service["spec"] == {"type": "ExternalName", "externalName": f"chat.worker-{i}.example.com",
                                   "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]}
        assert service["metadata"]["labels"] == route["metadata"]["labels"]
    assert kube_api.count("patch") == kube_api.count("patch", field_manager=MANAGER, content_type="application/apply-patch+yaml") == 4


async def test_a_weight_change_rewrites_only_the_route(kube_api: FakeKubeAPI, adapter: HttpRouteAdapter) -> None:
    async with gateway_controller(kube_api):
        await adapter.apply(by_key(pub("chat", 3, 1)), frozenset({pub("chat").key}))
        before = len(kube_api.requests)
        result = await adapter.apply(by_key(pub("chat", 1, 4, generation=3)), frozenset({pub("chat").key}))
    assert result.wrote and not result.rejected
    assert writes(kube_api, before) == [("patch", "httproutes/chat-eu")]
    route = kube_api.get(ROUTES, "prod", "chat-eu")
    assert route is not None and route["metadata"]["generation"] == 2
    assert [ref["weight"] for ref in route["spec"]["rules"][0]["backendRefs"]] == [1, 4]


async def test_a_backend_that_leaves_loses_its_service_after_the_route_drops_it(kube_api: FakeKubeAPI, adapter: HttpRouteAdapter) -> None:
    chat = pub("chat", 3, 1, 2)
    async with gateway_controller(kube_api):
        await adapter.apply(by_key(chat), frozenset({chat.key}))
        before = len(kube_api.requests)
        fewer = Publication("prod", "chat", "chat.example.com", 3, 6, chat.backends[:2])
        await adapter.apply(by_key(fewer), frozenset({chat.key}))
    gone = service_name(chat.key, "worker-2", "eu")
    assert writes(kube_api, before) == [("patch", "httproutes/chat-eu"), ("delete", f"services/{gone}")]
    assert kube_api.get(SERVICES, "prod", gone) is None


async def test_weight_zero_stays_listed_and_an_all_zero_route_is_published_with_a_note(kube_api: FakeKubeAPI, adapter: HttpRouteAdapter) -> None:
    drained, empty = pub("drained", 0, 0), pub("empty")
    async with gateway_controller(kube_api):
        result = await adapter.apply(by_key(drained, empty, pub("half", 0, 5)), frozenset({drained.key, empty.key, pub("half").key}))
    assert not result.rejected
    assert result.notes == {drained.key: ALL_ZERO_NOTE, empty.key: ALL_ZERO_NOTE}
    assert "500" in ALL_ZERO_NOTE
    half = kube_api.get(ROUTES, "prod", "half-eu")
    assert half is not None and [ref["weight"] for ref in half["spec"]["rules"][0]["backendRefs"]] == [0, 5]
    zero = kube_api.get(ROUTES, "prod", "drained-eu")
    assert zero is not None and [ref["weight"] for ref in zero["spec"]["rules"][0]["backendRefs"]] == [0, 0]
    no_backends = kube_api.get(ROUTES, "prod", "empty-eu")
    assert no_backends is not None and "backendRefs" not in no_backends["spec"]["rules"][0]


# --- what check() holds -----------------------------------------------------------------------------


def _with(base: Publication, **changes: Any) -> Publication:
    values = {"namespace": base.namespace, "name": base.name, "hostname": base.hostname, "generation": base.generation,
              "observed_isvc_generation": base.observed_isvc_generation, "backends": base.backends}
    return Publication(**{**values, **changes})


@pytest.mark.parametrize(
    ("publication", "words"),
    [
        (pub("many", *([1] * 17)), "at most 16 backendRefs"),
        (_with(pub("chat", 1), backends=(Backend("a", "http://a.example.com", 1_000_001),)), "outside 0..1000000"),
        (_with(pub("chat", 1), backends=(Backend("a", "http://a.example.com", -1),)), "outside 0..1000000"),
        (_with(pub("chat", 1), backends=(Backend("a", "http://10.0.0.7:8080", 1),)), "IP address"),
        (_with(pub("chat", 1), backends=(Backend("a", "http://[fd00::7]:8080", 1),)), "IP address"),
        (_with(pub("chat", 1), hostname="Chat.Example.com"), "not a lower-case DNS name"),
        (_with(pub("chat", 1), hostname="10.1.2.3"), "not a lower-case DNS name"),
        (_with(pub("chat", 1), hostname="chat.example.com\n"), "not a lower-case DNS name"),
        (_with(pub("chat", 1), backends=(Backend("Bad_Cluster", "http://a.example.com", 1),)), "not a DNS-1123 subdomain"),
        (_with(pub("chat", 1), backends=(Backend("a", "ftp://a.example.com", 1),)), "endpoint"),
        (_with(pub("chat", 1), backends=(Backend("a", "http://a.example.com\n", 1),)), "not an http(s) URL with a plain host"),
        (_with(pub("chat", 1), backends=(Backend("a", "http://a", 1), Backend("a", "http://b", 1))), "appears twice"),
    ],
)
def test_check_holds_what_an_httproute_cannot_carry(publication: Publication, words: str) -> None:
    held = HttpRouteAdapter(options()).check(publication)
    assert held is not None and held.reason == Reason.INVALID_PLAN and words in held.message


def test_check_passes_sixteen_backends_and_wildcard_hosts() -> None:
    adapter = HttpRouteAdapter(options())
    assert adapter.check(pub("many", *([0] * 15), 1_000_000)) is None
    assert adapter.check(_with(pub("chat", 1), hostname="*.chat.example.com")) is None


async def test_the_fake_refuses_seventeen_backend_refs_as_the_crd_does(kube_api: FakeKubeAPI, kube: Kube) -> None:
    # check() is our only guard: this is what the API server would answer without it.
    body = render_route(pub("many", *([1] * 17)), options())
    with pytest.raises(Exception, match="at most 16"):
        await kube.apply(HTTP_ROUTES, body, field_manager=MANAGER)


# --- names ------------------------------------------------------------------------------------------


def test_long_names_are_bounded_with_a_hash_and_stay_distinct() -> None:
    long_a, long_b = MapKey("prod", "m" * 70 + "a"), MapKey("prod", "m" * 70 + "b")
    assert route_name(MapKey("prod", "chat"), "eu") == "chat-eu"
    assert len(route_name(long_a, "eu")) <= 63 and route_name(long_a, "eu") != route_name(long_b, "eu")
    assert route_name(MapKey("prod", "chat"), "eu") != route_name(MapKey("prod", "chat"), "us")
    names = {service_name(key, cluster, "eu") for key in (long_a, long_b, MapKey("dev", "chat"), MapKey("prod", "chat"))
             for cluster in ("worker-a", "worker.b", "w" * 200)}
    assert len(names) == 12
    assert all(len(n) <= 63 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", n) for n in names)


def test_options_refuse_a_gateway_without_namespace_and_the_instance_name_global() -> None:
    with pytest.raises(ValueError, match="NAMESPACE/NAME"):
        options(gateway="global")
    with pytest.raises(ValueError, match="global"):
        options(name="global")
    with pytest.raises(ValueError):
        options(backend_port=0)


# --- routes that are not ours -----------------------------------------------------------------------


async def test_a_foreign_route_of_our_name_is_held_and_left_untouched(kube_api: FakeKubeAPI, adapter: HttpRouteAdapter) -> None:
    foreign = kube_api.create({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
        "metadata": {"name": "chat-eu", "namespace": "prod", "labels": {"team": "web"}},
        "spec": {"hostnames": ["web.example.com"], "rules": [{"backendRefs": [{"name": "web", "port": 80}]}]},
    })
    chat, other = pub("chat", 1, 2), pub("other", 1)
    async with gateway_controller(kube_api):
        result = await adapter.apply(by_key(chat, other), frozenset({chat.key, other.key}))
    assert set(result.rejected) == {chat.key}
    assert result.rejected[chat.key].reason == Reason.CLAIM_REJECTED
    assert "prod/chat-eu" in result.rejected[chat.key].message
    after = kube_api.get(ROUTES, "prod", "chat-eu")
    assert after is not None and after["metadata"]["resourceVersion"] == foreign["metadata"]["resourceVersion"]
    assert not [r for r in kube_api.requests if r.path.endswith("/chat-eu") and r.verb != "get"]
    assert all("chat" not in s["metadata"]["name"] for s in kube_api.objects(SERVICES))
    assert kube_api.get(ROUTES, "prod", "other-eu") is not None


async def test_two_maps_of_one_name_in_a_shared_route_namespace_do_not_take_each_other(kube_api: FakeKubeAPI, kube: Kube) -> None:
    adapter = HttpRouteAdapter(options(route_namespace="gateways", route_status_timeout=0.05), kube)
    await adapter.current()
    prod, dev = pub("chat", 1), pub("chat", 2, namespace="dev")
    await adapter.apply(by_key(prod), frozenset({prod.key}))
    result = await adapter.apply(by_key(prod, dev), frozenset({dev.key}))
    assert result.rejected[dev.key].reason == Reason.CLAIM_REJECTED and "prod/chat" in result.rejected[dev.key].message
    route = kube_api.get(ROUTES, "gateways", "chat-eu")
    assert route is not None and [r["weight"] for r in route["spec"]["rules"][0]["backendRefs"]] == [1]


# --- garbage collection -----------------------------------------------------------------------------


async def test_a_deleted_map_is_collected_after_a_restart_in_the_safe_order(kube_api: FakeKubeAPI, kube: Kube, adapter: HttpRouteAdapter) -> None:
    ome_route = kube_api.create({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
        "metadata": {"name": "chat-global", "namespace": "prod", "labels": {"ome.io/inferenceservice": "chat"}},
        "spec": {"hostnames": ["chat.example.com"], "rules": [{"backendRefs": [{"name": "chat-worker-0", "port": 8080}]}]},
    })
    chat, keep = pub("chat", 3, 1), pub("keep", 1)
    async with gateway_controller(kube_api):
        await adapter.apply(by_key(chat, keep), frozenset({chat.key, keep.key}))
    restarted = HttpRouteAdapter(options(), kube)
    assert await restarted.current() == by_key(chat, keep)
    before, since = len(kube_api.requests), kube_api.resource_version
    result = await restarted.apply(by_key(keep), frozenset({chat.key}))
    assert result.wrote and not result.rejected
    services = [service_name(chat.key, f"worker-{i}", "eu") for i in range(2)]
    assert writes(kube_api, before) == [
        ("patch", "httproutes/chat-eu"), ("delete", "httproutes/chat-eu"),
        ("delete", f"services/{services[0]}"), ("delete", f"services/{services[1]}"),
    ]
    # The route served weight 0 everywhere before it went away.
    async with kube.watch(HTTP_ROUTES, namespace="prod", resource_version=since, timeout_seconds=1) as stream:
        events = []
        while not events or events[-1]["type"] != "DELETED":
            event = json.loads(await stream.readline())
            if event["type"] != "BOOKMARK":
                events.append(event)
    assert [(e["type"], [r["weight"] for r in e["object"]["spec"]["rules"][0]["backendRefs"]]) for e in events] == [
        ("MODIFIED", [0, 0]), ("DELETED", [0, 0]),
    ]
    assert kube_api.get(ROUTES, "prod", "keep-eu") is not None
    assert kube_api.get(ROUTES, "prod", "chat-global") == ome_route
    assert not [r for r in kube_api.requests if r.path.endswith("/chat-global")]
    await restarted.aclose()


async def test_services_left_without_a_route_are_collected(kube_api: FakeKubeAPI, kube: Kube, adapter: HttpRouteAdapter) -> None:
    chat = pub("chat", 1, 1)
    async with gateway_controller(kube_api):
        await adapter.apply(by_key(chat), frozenset({chat.key}))
    kube_api.delete(ROUTES, "prod", "chat-eu")  # as a crash between the route's and the Services' deletion leaves it
    restarted = HttpRouteAdapter(options(), kube)
    assert await restarted.current() == {}
    await restarted.apply({}, frozenset())
    assert kube_api.objects(SERVICES) == []


# --- route status -----------------------------------------------------------------------------------


def refs_not_permitted(route: dict[str, Any]) -> tuple[str, str, str]:
    return "False", "RefNotPermitted", "backendRef chat-x in namespace prod is not permitted"


async def test_route_status_is_read_back_and_a_refusal_reported(kube_api: FakeKubeAPI, adapter: HttpRouteAdapter) -> None:
    chat = pub("chat", 1, 2)
    async with gateway_controller(kube_api, refs_not_permitted):
        result = await adapter.apply(by_key(chat), frozenset({chat.key}))
    held = result.rejected[chat.key]
    assert held.reason == Reason.APPLY_FAILED
    assert "RefNotPermitted: backendRef chat-x in namespace prod is not permitted" in held.message
    assert "ReferenceGrant" in held.message


async def test_a_gateway_that_has_not_reported_yet_is_noted_not_failed(kube_api: FakeKubeAPI, kube: Kube) -> None:
    adapter = HttpRouteAdapter(options(route_status_timeout=0.2), kube)
    await adapter.current()
    chat = pub("chat", 1, 0)
    result = await adapter.apply(by_key(chat), frozenset({chat.key}))
    assert not result.rejected and result.notes == {chat.key: NOT_REPORTED_NOTE}


def test_a_verdict_for_an_older_generation_is_no_verdict() -> None:
    def route(generation: int, observed: int, status: str) -> dict[str, Any]:
        conditions = [{"type": t, "status": status, "reason": "Whatever", "message": "m", "observedGeneration": observed}
                      for t in ("Accepted", "ResolvedRefs")]
        return {"metadata": {"namespace": "prod", "generation": generation},
                "status": {"parents": [{"parentRef": {"name": "global", "namespace": "gateways"}, "conditions": conditions}]}}

    assert route_verdict(route(2, 2, "True"), options()) is True
    assert route_verdict(route(3, 2, "True"), options()) is None
    assert route_verdict(route(3, 2, "True"), options(gateway="gateways/other")) is None
    refused = route_verdict(route(2, 2, "False"), options())
    assert refused == Held(Reason.APPLY_FAILED, "Accepted is False, Whatever: m")


# --- restarts and drift -----------------------------------------------------------------------------


async def test_a_restarted_sidecar_writes_nothing_when_nothing_changed(kube_api: FakeKubeAPI, kube: Kube, adapter: HttpRouteAdapter) -> None:
    desired = by_key(pub("chat", 3, 1), pub("drained", 0, 0), pub("empty"))
    async with gateway_controller(kube_api):
        await adapter.apply(desired, frozenset(desired))
        restarted = HttpRouteAdapter(options(), kube)
        assert await restarted.current() == desired
        before = len(kube_api.requests)
        result = await restarted.apply(desired, frozenset(desired))
    assert not result.wrote and not result.rejected
    assert writes(kube_api, before) == []
    await restarted.aclose()


async def test_a_route_edited_by_hand_reads_back_as_what_it_serves_and_is_rewritten(kube_api: FakeKubeAPI, kube: Kube, adapter: HttpRouteAdapter) -> None:
    chat = pub("chat", 3, 1)
    async with gateway_controller(kube_api):
        await adapter.apply(by_key(chat), frozenset({chat.key}))
    edited = kube_api.get(ROUTES, "prod", "chat-eu")
    assert edited is not None
    edited["spec"]["rules"][0]["backendRefs"][0]["weight"] = 100
    kube_api.update(edited)
    restarted = HttpRouteAdapter(options(route_status_timeout=0.05), kube)
    held = await restarted.current()
    assert [b.weight for b in held[chat.key].backends] == [100, 1]
    assert parse_route(edited, options()) == (held[chat.key], False)
    assert (await restarted.apply(by_key(chat), frozenset({chat.key}))).wrote
    route = kube_api.get(ROUTES, "prod", "chat-eu")
    assert route is not None and [r["weight"] for r in route["spec"]["rules"][0]["backendRefs"]] == [3, 1]


async def test_an_unreachable_api_server_is_unavailable_and_the_next_apply_catches_up(kube_api: FakeKubeAPI, adapter: HttpRouteAdapter) -> None:
    chat = pub("chat", 1, 2)
    kube_api.fail_next(1, 503, verb="patch")
    with pytest.raises(Unavailable):
        await adapter.apply(by_key(chat), frozenset({chat.key}))
    async with gateway_controller(kube_api):
        result = await adapter.apply(by_key(chat), frozenset({chat.key}))
    assert not result.rejected
    assert kube_api.get(ROUTES, "prod", "chat-eu") is not None


async def test_a_missing_namespace_fails_that_map_only(kube_api: FakeKubeAPI, adapter: HttpRouteAdapter) -> None:
    chat, other = pub("chat", 1), pub("other", 1)
    kube_api.fail_next(1, 404, verb="patch")
    async with gateway_controller(kube_api):
        result = await adapter.apply(by_key(chat, other), frozenset({chat.key, other.key}))
    # Which map's write meets the failure depends on scheduling; exactly one fails, the other publishes.
    [(failed, held)] = result.rejected.items()
    assert held.reason == Reason.APPLY_FAILED and "injected failure 404" in held.message
    survivor = other if failed == chat.key else chat
    assert kube_api.get(ROUTES, "prod", f"{survivor.name}-eu") is not None


def test_the_adapter_fits_the_protocol() -> None:
    assert isinstance(ADAPTERS["httproute"].engine("httproute", options()), Adapter)


async def test_without_a_kube_the_adapter_connects_from_its_kubeconfig_and_closes_it(kube_api: FakeKubeAPI, kubeconfig) -> None:
    adapter = HttpRouteAdapter(options(gateway_kubeconfig=kubeconfig, route_status_timeout=0.05))
    assert await adapter.current() == {}
    await adapter.apply(by_key(pub("chat", 1)), frozenset({pub("chat").key}))
    await adapter.aclose()
    assert kube_api.get(ROUTES, "prod", "chat-eu") is not None
