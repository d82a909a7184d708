"""The Gateway API transport's pure bookkeeping (adapters/httproute/owned.py), without a cluster."""

from __future__ import annotations

import copy

from adapters.httproute import HttpRouteOptions, HttpRouteRenderer, render_route, render_service
from adapters.httproute.owned import MapObjects, object_name, serves, service_spec, take_verdict
from publisher.model import Backend, Held, MapKey, Reason, Route

OPTIONS = HttpRouteOptions(gateway="infra/gw", backend_port=8080)
KEY = MapKey("prod", "llama")
GROUP = HttpRouteRenderer(OPTIONS).render(
    KEY, Route("llama.example.com", (Backend("east", "http://east.example.com:80", 3), Backend("west", "http://west.example.com:80", 1)))
)


def _services_as_rendered() -> dict[tuple[str, str], tuple[str, str] | None]:
    return {(GROUP.namespace, ref.service): (ref.cluster, ref.external_name) for ref in GROUP.refs}


def _objects(**changes) -> MapObjects:
    fields = {"route": (GROUP.namespace, GROUP.route), "group": GROUP, "exact": True, "services": _services_as_rendered()}
    return MapObjects(**{**fields, **changes})


def test_a_map_whose_route_and_services_are_as_rendered_serves_its_route():
    assert serves(_objects())


def test_a_map_does_not_serve_without_a_route_a_readable_group_or_an_exact_route():
    assert not serves(_objects(route=None))
    assert not serves(_objects(group=None))
    assert not serves(_objects(exact=False))


def test_a_refused_route_does_not_serve():
    assert not serves(_objects(refused=True))


def test_a_missing_or_differing_service_means_the_map_does_not_serve():
    first = (GROUP.namespace, GROUP.refs[0].service)
    missing = _services_as_rendered()
    del missing[first]
    assert not serves(_objects(services=missing))
    assert not serves(_objects(services={**_services_as_rendered(), first: None}))
    assert not serves(_objects(services={**_services_as_rendered(), first: ("east", "elsewhere.example.com")}))


def test_a_service_as_rendered_reads_back_as_its_cluster_and_external_name():
    ref = GROUP.refs[0]
    service = render_service(GROUP, ref, OPTIONS)
    service["metadata"]["uid"] = "added-by-the-server"  # fields of the server's own are ignored
    assert service_spec(service, GROUP, OPTIONS) == (ref.cluster, ref.external_name)


def test_a_service_that_differs_from_its_rendering_or_names_no_ref_reads_back_as_none():
    ref = GROUP.refs[0]
    edited = render_service(GROUP, ref, OPTIONS)
    edited["spec"]["externalName"] = "elsewhere.example.com"
    assert service_spec(edited, GROUP, OPTIONS) is None
    moved = render_service(GROUP, ref, OPTIONS)
    moved["metadata"]["namespace"] = "other"
    assert service_spec(moved, GROUP, OPTIONS) is None
    foreign = render_service(GROUP, ref, OPTIONS)
    foreign["metadata"]["annotations"]["gateway-publisher.ome.io/cluster"] = "north"
    assert service_spec(foreign, GROUP, OPTIONS) is None
    assert service_spec(render_service(GROUP, ref, OPTIONS), None, OPTIONS) is None


def _route_with_status(status: str, reason: str = "Accepted") -> dict:
    route = copy.deepcopy(render_route(GROUP, OPTIONS))
    route["metadata"]["generation"] = 2
    conditions = [
        {"type": kind, "status": status, "reason": reason, "observedGeneration": 2} for kind in ("Accepted", "ResolvedRefs")
    ]
    route["status"] = {"parents": [{"parentRef": {"name": "gw", "namespace": "infra"}, "conditions": conditions}]}
    return route


def test_a_verdict_is_taken_only_for_a_waiting_route_that_carries_one():
    name = object_name(render_route(GROUP, OPTIONS))
    assert name == (GROUP.namespace, GROUP.route)

    verdicts: dict = {KEY: None}
    waiting = {name: KEY}
    take_verdict(verdicts, waiting, render_route(GROUP, OPTIONS), OPTIONS)  # no status yet
    assert verdicts == {KEY: None} and waiting == {name: KEY}

    take_verdict(verdicts, waiting, _route_with_status("True"), OPTIONS)
    assert verdicts == {KEY: True} and waiting == {}

    take_verdict(verdicts, waiting, _route_with_status("False", "NotAllowedByListeners"), OPTIONS)  # no longer waiting
    assert verdicts == {KEY: True}


def test_a_refusal_is_taken_as_held_apply_failed():
    verdicts: dict = {KEY: None}
    take_verdict(verdicts, {(GROUP.namespace, GROUP.route): KEY}, _route_with_status("False", "RefNotPermitted"), OPTIONS)
    assert isinstance(verdicts[KEY], Held) and verdicts[KEY].reason == Reason.APPLY_FAILED
