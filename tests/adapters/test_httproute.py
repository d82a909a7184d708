from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import json
import re
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from adapters import ADAPTERS, Engine
from publisher import loop
from publisher.loop import LoopOptions, Publisher
from publisher.source.informer import WatchOptions
from publisher.source.kube_source import KubeSource
from publisher.source.store import Stores
from adapters.base import Adapter, Unavailable, publication_problem
from adapters.httproute import (
    ALL_ZERO_NOTE,
    NOT_REPORTED_NOTE,
    HttpRouteOptions,
    HttpRouteRenderer,
    HttpRouteTransport,
    ObjectGroup,
    UNKNOWN_ROUTE,
    build,
    parse_route,
    render_route,
    route_name,
    route_verdict,
    service_name,
)
from adapters.httproute.owned import OwnedObjects
from publisher.kube import HTTP_ROUTES, Kube
from publisher.core.values import Backend, Held, MapKey, Publication, Reason
from publisher.status import ConditionSink
from tests.fakes.kube_api import FakeKubeAPI
from tests.gateways import eventually
from tests.test_kube_integration import ours, rescale, seed

ROUTES = "gateway.networking.k8s.io/v1/httproutes"
SERVICES = "v1/services"
MANAGER = "ome-gateway-publisher-eu"
PARENT = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": "gateways", "name": "global"}


def options(**overrides: Any) -> HttpRouteOptions:
    values: dict[str, Any] = {"gateway": "gateways/global", "backend_port": 8080, "region": "eu", "route_status_timeout": 5.0}
    return HttpRouteOptions(**{**values, **overrides})


RENDERER = HttpRouteRenderer(options())


def pub(name: str, *weights: int, namespace: str = "prod", generation: int = 2) -> Publication:
    backends = tuple(Backend(f"worker-{i}", f"http://{name}.worker-{i}.example.com", w) for i, w in enumerate(weights))
    return Publication(namespace, name, f"{name}.example.com", generation, 6, backends)


def by_key(*pubs: Publication) -> dict[MapKey, Publication]:
    return {p.key: p for p in pubs}


def parts(*pubs: Publication, renderer: HttpRouteRenderer = RENDERER) -> dict[MapKey, ObjectGroup]:
    return {p.key: renderer.render(p.key, p.route) for p in pubs}


def group(p: Publication) -> ObjectGroup:
    return RENDERER.render(p.key, p.route)


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
async def transport(kube: Kube) -> AsyncIterator[HttpRouteTransport]:
    started = HttpRouteTransport(options(), kube)
    assert await started.read() == {}
    yield started
    await started.aclose()


def engine(kube: Kube, **overrides: Any) -> Engine[ObjectGroup]:
    """The gateway as the loop drives it, on our connection to the fake."""
    return Engine("httproute", HttpRouteRenderer(options(**overrides)), HttpRouteTransport(options(**overrides), kube))


async def restarted(kube: Kube, **overrides: Any) -> HttpRouteTransport:
    """A transport as a restarted sidecar starts one: read() first."""
    fresh = HttpRouteTransport(options(**overrides), kube)
    await fresh.read()
    return fresh


def writes(api: FakeKubeAPI, since: int = 0) -> list[tuple[str, str]]:
    return [(r.verb, r.path.rsplit("/", 2)[-2] + "/" + r.path.rsplit("/", 1)[-1]) for r in api.requests[since:] if r.verb in ("patch", "delete", "create", "update")]


async def publish(transport: HttpRouteTransport, *pubs: Publication, withdraw: tuple[MapKey, ...] = ()) -> Any:
    """One write as the engine sends it: `pubs` changed, `withdraw` removed; every map in `pubs`."""
    everything = parts(*pubs)
    return await transport.write(everything, {**everything, **dict.fromkeys(withdraw)})


# --- rendering: what a map's objects are -------------------------------------------------------------


def test_a_generation_is_not_part_of_what_is_written() -> None:
    # Finding 3: the old route carried the whole Publication, generation included, in an annotation.
    assert group(pub("chat", 3, 1, generation=2)) == group(pub("chat", 3, 1, generation=9))
    assert hash(group(pub("chat", 3, 1, generation=2))) == hash(group(pub("chat", 3, 1, generation=9)))
    assert "generation" not in json.dumps(render_route(group(pub("chat", 3, 1)), options())).lower()
    assert group(pub("chat", 3, 1)) != group(pub("chat", 3, 2))


async def test_a_generation_only_change_writes_nothing(kube_api: FakeKubeAPI, kube: Kube) -> None:
    # Finding 3, through the engine, and after a restart too: only the generation moves.
    gateway = engine(kube, route_status_timeout=0.05)
    await gateway.start()
    await gateway.apply(by_key(pub("chat", 3, 1, generation=2)))
    before = len(kube_api.requests)
    result = await gateway.apply(by_key(pub("chat", 3, 1, generation=3)))
    assert not result.rejected and not result.wrote
    fresh = engine(kube, route_status_timeout=0.05)
    await fresh.start()
    result = await fresh.apply(by_key(pub("chat", 3, 1, generation=4)))
    assert not result.rejected and not result.wrote
    assert writes(kube_api, before) == []
    await gateway.aclose()


# --- creating and changing a route -------------------------------------------------------------


async def test_a_map_becomes_a_route_and_external_name_services(kube_api: FakeKubeAPI, transport: HttpRouteTransport) -> None:
    chat = pub("chat", 3, 1, 0)
    async with gateway_controller(kube_api):
        result = await publish(transport, chat)
    assert not result.rejected and not result.notes
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
    assert parse_route(route, options()) == (group(chat), True)


async def test_a_weight_change_rewrites_only_the_route(kube_api: FakeKubeAPI, transport: HttpRouteTransport) -> None:
    async with gateway_controller(kube_api):
        await publish(transport, pub("chat", 3, 1))
        before = len(kube_api.requests)
        result = await publish(transport, pub("chat", 1, 4, generation=3))
    assert not result.rejected
    assert writes(kube_api, before) == [("patch", "httproutes/chat-eu")]
    route = kube_api.get(ROUTES, "prod", "chat-eu")
    assert route is not None and route["metadata"]["generation"] == 2
    assert [ref["weight"] for ref in route["spec"]["rules"][0]["backendRefs"]] == [1, 4]


async def test_a_backend_that_leaves_loses_its_service_after_the_route_drops_it(kube_api: FakeKubeAPI, transport: HttpRouteTransport) -> None:
    chat = pub("chat", 3, 1, 2)
    async with gateway_controller(kube_api):
        await publish(transport, chat)
        before = len(kube_api.requests)
        await publish(transport, Publication("prod", "chat", "chat.example.com", 3, 6, chat.backends[:2]))
    gone = service_name(chat.key, "worker-2", "eu")
    assert writes(kube_api, before) == [("patch", "httproutes/chat-eu"), ("delete", f"services/{gone}")]
    assert kube_api.get(SERVICES, "prod", gone) is None


async def test_weight_zero_stays_listed_and_an_all_zero_route_is_published_with_a_note(kube_api: FakeKubeAPI, transport: HttpRouteTransport) -> None:
    drained, empty = pub("drained", 0, 0), pub("empty")
    async with gateway_controller(kube_api):
        result = await publish(transport, drained, empty, pub("half", 0, 5))
    assert not result.rejected
    assert result.notes == {drained.key: ALL_ZERO_NOTE, empty.key: ALL_ZERO_NOTE}
    assert "500" in ALL_ZERO_NOTE
    half = kube_api.get(ROUTES, "prod", "half-eu")
    assert half is not None and [ref["weight"] for ref in half["spec"]["rules"][0]["backendRefs"]] == [0, 5]
    zero = kube_api.get(ROUTES, "prod", "drained-eu")
    assert zero is not None and [ref["weight"] for ref in zero["spec"]["rules"][0]["backendRefs"]] == [0, 0]
    no_backends = kube_api.get(ROUTES, "prod", "empty-eu")
    assert no_backends is not None and "backendRefs" not in no_backends["spec"]["rules"][0]


# --- scale: requests per map, concurrency --------------------------------------------------------------


async def test_a_first_publish_sends_five_writes_a_map_and_no_read_per_map(kube_api: FakeKubeAPI, kube: Kube) -> None:
    # The old adapter sent 7 requests a map, one after another (a GET before and after each apply).
    # 130 maps: more Services (520) than one list page, and more maps than are looked up one by one.
    many = [pub(f"m{i:03d}", 1, 2, 3, 4) for i in range(130)]
    kube_api.set_latency(0.002)  # so requests overlap, as they do against a real server
    async with gateway_controller(kube_api):
        gateway = engine(kube)
        assert await gateway.start() == {}
        result = await gateway.apply(by_key(*many))
    assert not result.rejected and not result.notes  # every verdict came, through one list and a watch
    assert kube_api.count("patch") == 5 * 130
    assert kube_api.count("get") == 0
    assert kube_api.count("list") <= 8  # ours at start, one of every route for the claims, status polls
    assert 1 < kube_api.peak_in_flight <= 32
    fresh = await restarted(kube)
    assert len(await fresh.read()) == 130  # the Services take two pages
    await gateway.aclose()


async def test_one_change_among_many_costs_one_write_and_no_list(kube_api: FakeKubeAPI, kube: Kube) -> None:
    many = [pub(f"m{i:03d}", 1, 2) for i in range(40)]
    async with gateway_controller(kube_api):
        transport = await restarted(kube)
        await publish(transport, *many)
        before = len(kube_api.requests)
        changed = pub("m007", 5, 2, generation=3)
        result = await transport.write({**parts(*many), **parts(changed)}, parts(changed))
    assert not result.rejected
    assert writes(kube_api, before) == [("patch", "httproutes/m007-eu")]
    later = kube_api.requests[before:]
    assert not [r for r in later if r.verb == "list"]
    assert all(r.path.endswith("/m007-eu") for r in later)  # the status reads are of that route only
    await transport.aclose()


# --- what problem() holds ---------------------------------------------------------------------------


def _with(base: Publication, **changes: Any) -> Publication:
    values = {"namespace": base.namespace, "name": base.name, "hostname": base.hostname, "generation": base.generation,
              "observed_isvc_generation": base.observed_isvc_generation, "backends": base.backends}
    return Publication(**{**values, **changes})


def refused(p: Publication) -> str | None:
    """What stops `p`: the shared strict checks (the engine's), then the renderer's own."""
    return publication_problem(p) or RENDERER.problem(p.key, p.route)


@pytest.mark.parametrize(
    ("publication", "words"),
    [
        (pub("many", *([1] * 17)), "at most 16 backendRefs"),
        (_with(pub("chat", 1), backends=(Backend("a", "http://a.example.com", 1_000_001),)), "outside 0..1000000"),
        (_with(pub("chat", 1), backends=(Backend("a", "http://a.example.com", -1),)), "outside 0..1000000"),
        (_with(pub("chat", 1), backends=(Backend("a", "http://10.0.0.7:8080", 1),)), "IP address"),
        (_with(pub("chat", 1), backends=(Backend("a", "http://[fd00::7]:8080", 1),)), "IP address"),
        (_with(pub("chat", 1), hostname="Chat.Example.com"), "not a lower-case DNS name"),
        (_with(pub("chat", 1), hostname="10.1.2.3"), "hostname"),
        (_with(pub("chat", 1), hostname="chat.example.com\n"), "not a lower-case DNS name"),
        (_with(pub("chat", 1), backends=(Backend("Bad_Cluster", "http://a.example.com", 1),)), "not a DNS-1123 subdomain"),
        (_with(pub("chat", 1), backends=(Backend("a", "ftp://a.example.com", 1),)), "endpoint"),
        (_with(pub("chat", 1), backends=(Backend("a", "http://a.example.com\n", 1),)), "not an http(s) URL with a plain host"),
        (_with(pub("chat", 1), backends=(Backend("a", "http://a", 1), Backend("a", "http://b", 1))), "appears twice"),
    ],
)
def test_problem_names_what_an_httproute_cannot_carry(publication: Publication, words: str) -> None:
    problem = refused(publication)
    assert problem is not None and words in problem


def test_the_renderer_alone_refuses_seventeen_backends_and_ip_hosts() -> None:
    assert "at most 16" in (RENDERER.problem(MapKey("prod", "many"), pub("many", *([1] * 17)).route) or "")
    assert "IP address" in (RENDERER.problem(MapKey("prod", "chat"), _with(pub("chat", 1), hostname="10.1.2.3").route) or "")


def test_sixteen_backends_and_wildcard_hosts_pass() -> None:
    assert refused(pub("many", *([0] * 15), 1_000_000)) is None
    assert refused(_with(pub("chat", 1), hostname="*.chat.example.com")) is None


def test_the_engine_holds_a_problem_as_invalid_plan() -> None:
    held = ADAPTERS["httproute"].engine("httproute", options()).check(pub("many", *([1] * 17)))
    assert held is not None and held.reason == Reason.INVALID_PLAN and "at most 16" in held.message


async def test_the_fake_refuses_seventeen_backend_refs_as_the_crd_does(kube_api: FakeKubeAPI, kube: Kube) -> None:
    # problem() is our only guard: this is what the API server would answer without it.
    body = render_route(group(pub("many", *([1] * 17))), options())
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
        options(region="global")
    with pytest.raises(ValueError):
        options(backend_port=0)


# --- routes that are not ours -----------------------------------------------------------------------


@pytest.mark.parametrize("maps", [2, 40], ids=["looked-up-one-by-one", "looked-up-in-one-list"])
async def test_a_foreign_route_of_our_name_is_a_claim_rejected_and_left_untouched(kube_api: FakeKubeAPI, transport: HttpRouteTransport, maps: int) -> None:
    foreign = kube_api.create({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
        "metadata": {"name": "chat-eu", "namespace": "prod", "labels": {"team": "web"}},
        "spec": {"hostnames": ["web.example.com"], "rules": [{"backendRefs": [{"name": "web", "port": 80}]}]},
    })
    chat, others = pub("chat", 1, 2), [pub(f"other{i}", 1) for i in range(maps - 1)]
    async with gateway_controller(kube_api):
        result = await publish(transport, chat, *others)
    assert set(result.rejected) == {chat.key}
    assert result.rejected[chat.key].reason == Reason.CLAIM_REJECTED and "prod/chat-eu" in result.rejected[chat.key].message
    after = kube_api.get(ROUTES, "prod", "chat-eu")
    assert after is not None and after["metadata"]["resourceVersion"] == foreign["metadata"]["resourceVersion"]
    assert not [r for r in kube_api.requests if r.path.endswith("/chat-eu") and r.verb != "get"]
    assert all("chat" not in s["metadata"]["name"] for s in kube_api.objects(SERVICES))
    assert all(kube_api.get(ROUTES, "prod", f"{o.name}-eu") is not None for o in others)


async def test_the_engine_reports_a_claim_as_claim_rejected(kube_api: FakeKubeAPI, kube: Kube) -> None:
    kube_api.create({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
                     "metadata": {"name": "chat-eu", "namespace": "prod"}, "spec": {"hostnames": ["web.example.com"]}})
    gateway = engine(kube, route_status_timeout=0.05)
    await gateway.start()
    result = await gateway.apply(by_key(pub("chat", 1)))
    assert result.rejected[pub("chat").key] == Held(
        Reason.CLAIM_REJECTED, "route prod/chat-eu exists without this publisher's labels; it is left untouched"
    )
    assert pub("chat").key not in gateway.confirmed
    await gateway.aclose()


async def test_two_maps_of_one_name_in_a_shared_route_namespace_do_not_take_each_other(kube_api: FakeKubeAPI, kube: Kube) -> None:
    shared = HttpRouteRenderer(options(route_namespace="gateways"))
    transport = await restarted(kube, route_namespace="gateways", route_status_timeout=0.05)
    prod, dev = pub("chat", 1), pub("chat", 2, namespace="dev")
    await transport.write(parts(prod, renderer=shared), parts(prod, renderer=shared))
    result = await transport.write(parts(prod, dev, renderer=shared), parts(dev, renderer=shared))
    assert result.rejected[dev.key] == Held(Reason.CLAIM_REJECTED, "route gateways/chat-eu already publishes prod/chat")
    route = kube_api.get(ROUTES, "gateways", "chat-eu")
    assert route is not None and [r["weight"] for r in route["spec"]["rules"][0]["backendRefs"]] == [1]
    # Asked for at once by a fresh sidecar, the name goes to the first map in key order, every time.
    kube_api.delete(ROUTES, "gateways", "chat-eu")
    fresh = await restarted(kube, route_namespace="gateways", route_status_timeout=0.05)
    both = parts(prod, dev, renderer=shared)
    result = await fresh.write(both, both)
    assert set(result.rejected) == {prod.key}  # dev/chat sorts before prod/chat
    await transport.aclose()
    await fresh.aclose()


# --- garbage collection -----------------------------------------------------------------------------


async def test_a_deleted_map_is_collected_after_a_restart_in_the_safe_order(kube_api: FakeKubeAPI, kube: Kube, transport: HttpRouteTransport) -> None:
    ome_route = kube_api.create({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
        "metadata": {"name": "chat-global", "namespace": "prod", "labels": {"ome.io/inferenceservice": "chat"}},
        "spec": {"hostnames": ["chat.example.com"], "rules": [{"backendRefs": [{"name": "chat-worker-0", "port": 8080}]}]},
    })
    chat, keep = pub("chat", 3, 1), pub("keep", 1)
    async with gateway_controller(kube_api):
        await publish(transport, chat, keep)
    fresh = HttpRouteTransport(options(), kube)
    assert await fresh.read() == {chat.key: chat.route, keep.key: keep.route}
    before, since = len(kube_api.requests), kube_api.resource_version
    result = await fresh.write(parts(keep), {chat.key: None})
    assert not result.rejected
    services = [service_name(chat.key, f"worker-{i}", "eu") for i in range(2)]
    assert writes(kube_api, before)[:2] == [("patch", "httproutes/chat-eu"), ("delete", "httproutes/chat-eu")]
    assert sorted(writes(kube_api, before)[2:]) == [("delete", f"services/{s}") for s in sorted(services)]
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
    assert await fresh.read() == {keep.key: keep.route}
    await fresh.aclose()


async def test_services_left_without_a_route_are_collected(kube_api: FakeKubeAPI, kube: Kube, transport: HttpRouteTransport) -> None:
    chat = pub("chat", 1, 1)
    async with gateway_controller(kube_api):
        await publish(transport, chat)
    kube_api.delete(ROUTES, "prod", "chat-eu")  # as a crash between the route's and the Services' deletion leaves it
    fresh = HttpRouteTransport(options(), kube)
    assert await fresh.read() == {}
    await fresh.write({}, {})
    assert kube_api.objects(SERVICES) == []


# --- route status -----------------------------------------------------------------------------------


def refs_not_permitted(route: dict[str, Any]) -> tuple[str, str, str]:
    return "False", "RefNotPermitted", "backendRef chat-x in namespace prod is not permitted"


async def test_route_status_is_read_back_and_a_refusal_reported(kube_api: FakeKubeAPI, transport: HttpRouteTransport) -> None:
    chat = pub("chat", 1, 2)
    async with gateway_controller(kube_api, refs_not_permitted):
        result = await publish(transport, chat)
    held = result.rejected[chat.key]
    assert held.reason == Reason.APPLY_FAILED
    assert "RefNotPermitted: backendRef chat-x in namespace prod is not permitted" in held.message
    assert "ReferenceGrant" in held.message


async def test_a_refused_route_stays_refused_until_the_gateway_takes_it_and_is_not_read_as_served(kube_api: FakeKubeAPI, kube: Kube, transport: HttpRouteTransport) -> None:
    chat = pub("chat", 1, 2)
    async with gateway_controller(kube_api, refs_not_permitted):
        assert chat.key in (await publish(transport, chat)).rejected
        before = len(kube_api.requests)
        again = await publish(transport, chat)  # the engine retries the same route
    assert again.rejected[chat.key].reason == Reason.APPLY_FAILED
    assert writes(kube_api, before) == []
    assert await (await restarted(kube)).read() == {chat.key: UNKNOWN_ROUTE}
    route = kube_api.get(ROUTES, "prod", "chat-eu")
    assert route is not None
    route["status"]["parents"][0]["conditions"][1]["status"] = "True"  # a ReferenceGrant appeared
    kube_api.update(route)
    result = await publish(transport, chat)
    assert not result.rejected and writes(kube_api, before) == []
    assert await (await restarted(kube)).read() == {chat.key: chat.route}


async def test_a_gateway_that_has_not_reported_yet_is_noted_not_failed(kube_api: FakeKubeAPI, kube: Kube) -> None:
    transport = await restarted(kube, route_status_timeout=0.2)
    chat = pub("chat", 1, 0)
    result = await publish(transport, chat)
    assert not result.rejected and result.notes == {chat.key: NOT_REPORTED_NOTE}


async def test_a_restart_read_takes_pages_of_at_most_100_objects_with_a_turn_of_the_loop_between(kube_api: FakeKubeAPI, kube: Kube, monkeypatch: pytest.MonkeyPatch) -> None:
    """A page is decoded in one call and parsed in one go: at 500 objects that held the event loop
    20-60 ms (issue 29). Every list asks for at most 100, and the loop turns between two pages."""
    transport = await restarted(kube, route_status_timeout=0.1)
    await publish(transport, *(pub(f"m{i:03d}", 1) for i in range(130)))  # 130 routes, 130 Services
    await transport.aclose()
    turns = 0
    limits: list[int | None] = []
    parsed_in_turn: collections.Counter[int] = collections.Counter()

    async def ticker() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    list_ = kube.list

    async def counted_list(*args: Any, **kwargs: Any) -> Any:
        limits.append(kwargs.get("limit"))
        return await list_(*args, **kwargs)

    def counted(add: Callable[..., Any]) -> Callable[..., Any]:
        def add_counted(self: Any, obj: Any) -> Any:
            parsed_in_turn[turns] += 1
            return add(self, obj)
        return add_counted

    monkeypatch.setattr(kube, "list", counted_list)
    monkeypatch.setattr(OwnedObjects, "add_route", counted(OwnedObjects.add_route))
    monkeypatch.setattr(OwnedObjects, "add_service", counted(OwnedObjects.add_service))
    ticking = asyncio.create_task(ticker())
    try:
        fresh = await restarted(kube)
    finally:
        ticking.cancel()
    assert len(limits) == 4 and all(limit is not None and limit <= 100 for limit in limits)  # 2 pages of each kind
    assert sum(parsed_in_turn.values()) == 260 and max(parsed_in_turn.values()) <= 100
    await fresh.aclose()


class _Answer(dict):  # type: ignore[type-arg]
    """An API answer that can be watched for: a dict a weak reference can point at."""


@pytest.mark.parametrize("maps", [3, 40])  # status read by GETs, and by one list and a watch
async def test_a_write_keeps_only_the_verdict_of_each_route_the_server_answered_with(kube_api: FakeKubeAPI, kube: Kube, monkeypatch: pytest.MonkeyPatch, maps: int) -> None:
    """While a write waits for verdicts, no route the server answered with is held (10,000 whole
    routes were, at a first publish): every status read finds them all gone."""
    answers: list[weakref.ref[_Answer]] = []
    held_while_waiting: list[int] = []
    apply, get, list_ = kube.apply, kube.get, kube.list

    async def tracked_apply(resource: Any, body: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        answer = _Answer(await apply(resource, body, **kwargs))
        if resource is HTTP_ROUTES:
            answers.append(weakref.ref(answer))
        return answer

    def counting(read: Callable[..., Any]) -> Callable[..., Any]:
        async def counted(*args: Any, **kwargs: Any) -> Any:
            gc.collect()
            held_while_waiting.append(sum(answer() is not None for answer in answers))
            return await read(*args, **kwargs)
        return counted

    transport = await restarted(kube, route_status_timeout=0.2)
    monkeypatch.setattr(kube, "apply", tracked_apply)
    monkeypatch.setattr(kube, "get", counting(get))
    monkeypatch.setattr(kube, "list", counting(list_))
    many = [pub(f"m{i:03d}", 1, 2) for i in range(maps)]
    result = await publish(transport, *many)
    assert set(result.notes) == {p.key for p in many}  # no controller: every map waited for its verdict
    assert len(answers) == maps and held_while_waiting and held_while_waiting[-1] == 0
    await transport.aclose()


def test_a_verdict_for_an_older_generation_is_no_verdict() -> None:
    def route(generation: int, observed: int, status: str) -> dict[str, Any]:
        conditions = [{"type": t, "status": status, "reason": "Whatever", "message": "m", "observedGeneration": observed}
                      for t in ("Accepted", "ResolvedRefs")]
        return {"metadata": {"namespace": "prod", "generation": generation},
                "status": {"parents": [{"parentRef": {"name": "global", "namespace": "gateways"}, "conditions": conditions}]}}

    assert route_verdict(route(2, 2, "True"), options()) is True
    assert route_verdict(route(3, 2, "True"), options()) is None
    assert route_verdict(route(3, 2, "True"), options(gateway="gateways/other")) is None
    refused_route = route_verdict(route(2, 2, "False"), options())
    assert refused_route == Held(Reason.APPLY_FAILED, "Accepted is False, Whatever: m")


# --- restarts and drift -----------------------------------------------------------------------------


async def test_a_restarted_sidecar_writes_nothing_when_nothing_changed(kube_api: FakeKubeAPI, kube: Kube, transport: HttpRouteTransport) -> None:
    maps = (pub("chat", 3, 1), pub("drained", 0, 0), pub("empty"))
    async with gateway_controller(kube_api):
        await publish(transport, *maps)
        fresh = HttpRouteTransport(options(), kube)
        assert await fresh.read() == {p.key: p.route for p in maps}
        before = len(kube_api.requests)
        result = await publish(fresh, *maps)
    assert not result.rejected
    assert writes(kube_api, before) == []
    await fresh.aclose()


async def test_a_route_edited_by_hand_reads_back_as_what_it_serves_and_is_rewritten(kube_api: FakeKubeAPI, kube: Kube, transport: HttpRouteTransport) -> None:
    chat = pub("chat", 3, 1)
    async with gateway_controller(kube_api):
        await publish(transport, chat)
    edited = kube_api.get(ROUTES, "prod", "chat-eu")
    assert edited is not None
    edited["spec"]["rules"][0]["backendRefs"][0]["weight"] = 100
    kube_api.update(edited)
    fresh = await restarted(kube, route_status_timeout=0.05)
    served = await fresh.read()
    assert [b.weight for b in served[chat.key].backends] == [100, 1]
    await publish(fresh, chat)
    route = kube_api.get(ROUTES, "prod", "chat-eu")
    assert route is not None and [r["weight"] for r in route["spec"]["rules"][0]["backendRefs"]] == [3, 1]


@pytest.mark.parametrize(
    "edit",
    [
        lambda api: api.update({**(r := api.get(ROUTES, "prod", "chat-eu")), "spec": {**r["spec"], "parentRefs": [{**PARENT, "name": "other"}]}}),
        lambda api: api.update({**(s := api.objects(SERVICES)[0]), "spec": {**s["spec"], "externalName": "evil.example.com"}}),
        lambda api: api.delete(SERVICES, "prod", api.objects(SERVICES)[0]["metadata"]["name"]),
    ],
    ids=["route-moved-to-another-gateway", "service-pointed-elsewhere", "service-deleted"],
)
async def test_objects_not_as_we_render_them_are_not_read_as_served_and_are_rewritten(kube_api: FakeKubeAPI, kube: Kube, transport: HttpRouteTransport, edit: Callable[[FakeKubeAPI], Any]) -> None:
    chat = pub("chat", 3, 1)
    await publish(transport, chat)
    edit(kube_api)
    gateway = engine(kube, route_status_timeout=0.05)
    assert await gateway.start() == {chat.key: UNKNOWN_ROUTE}
    assert not (await gateway.apply(by_key(chat))).rejected
    assert await (await restarted(kube)).read() == {chat.key: chat.route}


@pytest.mark.parametrize(
    "edit",
    [
        lambda api: api.update({**(r := api.get(ROUTES, "prod", "chat-eu")), "spec": {**r["spec"], "parentRefs": [{**PARENT, "name": "other"}]}}),
        lambda api: api.delete(SERVICES, "prod", api.objects(SERVICES)[0]["metadata"]["name"]),
    ],
    ids=["route-moved-to-another-gateway", "service-deleted"],
)
async def test_objects_not_as_we_render_them_are_collected_when_their_map_goes(kube_api: FakeKubeAPI, kube: Kube, transport: HttpRouteTransport, edit: Callable[[FakeKubeAPI], Any]) -> None:
    chat = pub("chat", 3, 1)
    await publish(transport, chat)
    edit(kube_api)
    gateway = engine(kube, route_status_timeout=0.05)
    await gateway.start()
    await gateway.apply({chat.key: None})  # the map was deleted while the sidecar was down
    assert kube_api.objects(ROUTES) == [] and kube_api.objects(SERVICES) == []


async def test_an_unreachable_api_server_is_unavailable_and_the_next_write_catches_up(kube_api: FakeKubeAPI, transport: HttpRouteTransport) -> None:
    chat = pub("chat", 1, 2)
    kube_api.fail_next(1, 503, verb="patch")
    with pytest.raises(Unavailable):
        await publish(transport, chat)
    await transport.read()  # what the engine does after an Unavailable
    async with gateway_controller(kube_api):
        result = await publish(transport, chat)
    assert not result.rejected
    assert await transport.read() == {chat.key: chat.route}


async def test_an_api_server_that_fails_stops_the_write_early(kube_api: FakeKubeAPI, transport: HttpRouteTransport) -> None:
    many = [pub(f"m{i:03d}", 1, 2) for i in range(200)]
    kube_api.fail_next(1000, 503, verb="patch")
    with pytest.raises(Unavailable, match="503"):
        await publish(transport, *many)
    assert kube_api.count("patch") < 200  # not one failed request for every object


async def test_a_missing_namespace_fails_that_map_only(kube_api: FakeKubeAPI, transport: HttpRouteTransport) -> None:
    chat, other = pub("chat", 1), pub("other", 1)
    kube_api.fail_next(1, 404, verb="patch")
    async with gateway_controller(kube_api):
        result = await publish(transport, chat, other)
    # Which map's write meets the failure depends on scheduling; exactly one fails, the other publishes.
    [(failed, message)] = result.rejected.items()
    assert isinstance(message, str) and "injected failure 404" in message
    survivor = other if failed == chat.key else chat
    assert kube_api.get(ROUTES, "prod", f"{survivor.name}-eu") is not None


def test_build_gives_a_renderer_and_a_transport() -> None:
    renderer, transport = build(options())
    assert isinstance(renderer, HttpRouteRenderer) and isinstance(transport, HttpRouteTransport)
    assert transport.hold_off() == 0 and transport.unready() is None


def test_the_registry_builds_an_engine_that_fits_the_protocol() -> None:
    assert isinstance(ADAPTERS["httproute"].engine("httproute", options()), Adapter)


async def test_without_a_kube_the_transport_connects_from_its_kubeconfig_and_closes_it(kube_api: FakeKubeAPI, kubeconfig) -> None:
    transport = HttpRouteTransport(options(gateway_kubeconfig=kubeconfig, route_status_timeout=0.05))
    assert await transport.read() == {}
    await publish(transport, pub("chat", 1))
    await transport.serve()
    await transport.aclose()
    assert kube_api.get(ROUTES, "prod", "chat-eu") is not None


# --- through the loop -------------------------------------------------------------------------------


def weights(api: FakeKubeAPI, name: str) -> list[int] | None:
    route = api.get(ROUTES, "prod", f"{name}-eu")
    return None if route is None else [r["weight"] for r in route["spec"]["rules"][0].get("backendRefs", [])]


async def test_a_traffic_map_reaches_its_route_through_the_loop(kube_api: FakeKubeAPI, kube: Kube, kubeconfig) -> None:
    # The sidecar as it runs: kube source, the registry's engine for httproute, status reports.
    seed(kube_api)
    stores = Stores.empty()
    gateway = ADAPTERS["httproute"].engine("httproute", options(gateway_kubeconfig=kubeconfig, route_status_timeout=0.5))
    publisher = Publisher(stores, gateway, LoopOptions(region="eu", resync=3600), status_sink=ConditionSink(kube, stores.maps, "eu"))
    source = KubeSource(kube, stores, publisher, WatchOptions(backoff_initial=0.05, backoff_max=0.5, silence_timeout=5), clock=publisher.clock)
    async with gateway_controller(kube_api):
        task = asyncio.create_task(loop.run(publisher, source))
        try:
            await eventually(lambda: weights(kube_api, "chat") == [2, 3] or task.done())
            await eventually(lambda: ours(kube_api).get("reason") == "Published")
            rescale(kube_api, "chat", 4)
            await eventually(lambda: weights(kube_api, "chat") == [1, 3] or task.done())
            await eventually(lambda: ours(kube_api).get("observedGeneration") == 2)
            assert ours(kube_api)["reason"] == "Published"
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
