"""The Gateway API transport's pure bookkeeping (adapters/httproute/owned.py), without a cluster."""

from __future__ import annotations

import copy
import sys

from adapters.httproute import UNKNOWN_ROUTE, HttpRouteOptions, HttpRouteRenderer, render_route, render_service
from adapters.httproute.owned import MapObjects, OwnedObjects, object_name, serves, service_spec, take_verdict
from publisher.core.values import Backend, Held, MapKey, Reason, Route

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


# --- OwnedObjects: every map's objects, claims, and what a write must do -------------------------------

OTHER = HttpRouteRenderer(OPTIONS).render(MapKey("prod", "mistral"), Route("mistral.example.com", (Backend("east", "http://m.east.example.com", 1),)))


def _listed(owned: OwnedObjects, group=GROUP, *, services: bool = True) -> OwnedObjects:
    """`owned` after a read of `group`'s route (and its Services) as rendered."""
    owned.add_route(render_route(group, OPTIONS))
    if services:
        for ref in group.refs:
            owned.add_service(render_service(group, ref, OPTIONS))
    return owned


def test_a_read_of_objects_as_rendered_serves_their_route_and_a_differing_one_is_unknown():
    owned = _listed(OwnedObjects(OPTIONS))
    assert dict(owned.served()) == {KEY: GROUP.served}
    assert dict(_listed(OwnedObjects(OPTIONS), services=False).served()) == {KEY: UNKNOWN_ROUTE}


def test_objects_that_name_no_map_are_not_taken_in():
    owned = OwnedObjects(OPTIONS)
    stranger = render_route(GROUP, OPTIONS)
    del stranger["metadata"]["annotations"]
    stranger["metadata"]["labels"] = {}
    assert owned.add_route(stranger) is None and owned.add_service(stranger) is None
    assert dict(owned.served()) == {}


def test_what_a_read_keeps_of_a_listed_route_is_a_few_fields_not_the_object():
    """No container of the listed JSON is referenced after add_route: the page can go at once."""
    route = _route_with_status("True")
    containers = [route, route["metadata"], route["metadata"]["annotations"], route["metadata"]["labels"], route["spec"], route["status"]]
    counts = [sys.getrefcount(c) for c in containers]
    owned = OwnedObjects(OPTIONS)
    assert owned.add_route(route) == KEY
    assert [sys.getrefcount(c) for c in containers] == counts


def test_services_without_a_route_are_withdrawn_unless_a_write_keeps_their_map():
    owned = OwnedObjects(OPTIONS)
    for ref in GROUP.refs:
        owned.add_service(render_service(GROUP, ref, OPTIONS))
    assert dict(owned.served()) == {}
    assert owned.withdrawals({}, {}) == [KEY]
    assert owned.withdrawals({KEY: GROUP}, {}) == []
    assert owned.withdrawals({}, {OTHER.key: None}) == sorted([KEY, OTHER.key])
    owned.orphans_collected()
    assert owned.withdrawals({}, {}) == []


def test_a_route_name_is_claimed_by_the_first_map_and_a_taken_one_is_given_up():
    twin = HttpRouteRenderer(OPTIONS).render(MapKey("prod", "zz"), Route("zz.example.com", ()))
    twin = type(twin)(twin.key, GROUP.namespace, GROUP.route, twin.hostname, ())  # asks for GROUP's name
    owned = OwnedObjects(OPTIONS)
    rejected, lookup = owned.claim({KEY: GROUP, twin.key: twin})
    assert lookup == [KEY] and list(rejected) == [twin.key] and rejected[twin.key].reason == Reason.CLAIM_REJECTED

    foreign = render_route(GROUP, OPTIONS)
    foreign["metadata"]["labels"] = {}
    refusal = owned.settle_claim(GROUP, foreign)
    assert refusal is not None and "without this publisher's labels" in refusal.message
    assert owned.claim({twin.key: twin}) == ({}, [twin.key])  # the name was given up

    owned = OwnedObjects(OPTIONS)
    owned.claim({KEY: GROUP})
    assert owned.settle_claim(GROUP, render_route(GROUP, OPTIONS)) is None  # ours for this map already
    assert owned.settle_claim(GROUP, None) is None
    assert owned.claim({KEY: GROUP}) == ({}, [])  # held now: no lookup again


def test_a_write_applies_only_what_differs_and_deletes_what_the_route_dropped():
    owned = OwnedObjects(OPTIONS)
    assert owned.stale_services(GROUP) == [((GROUP.namespace, r.service), r) for r in GROUP.refs]
    assert owned.route_stale(GROUP) and owned.route_moved(GROUP) is None
    for (name, ref) in owned.stale_services(GROUP):
        owned.service_written(KEY, name, ref)
    owned.route_written(GROUP)
    assert owned.stale_services(GROUP) == [] and not owned.route_stale(GROUP) and owned.unused_services(GROUP) == []

    narrower = type(GROUP)(KEY, GROUP.namespace, GROUP.route, GROUP.hostname, GROUP.refs[:1])
    assert owned.route_stale(narrower)
    assert owned.unused_services(narrower) == [(GROUP.namespace, GROUP.refs[1].service)]
    moved = type(GROUP)(KEY, "elsewhere", GROUP.route, GROUP.hostname, GROUP.refs)
    assert owned.route_moved(moved) == (GROUP.namespace, GROUP.route)
    owned.route_written(moved)
    assert owned.claim({OTHER.key: type(OTHER)(OTHER.key, GROUP.namespace, GROUP.route, "x", ())}) == ({}, [OTHER.key])


def test_a_refusal_is_remembered_until_the_next_verdict():
    owned = _listed(OwnedObjects(OPTIONS))
    assert not owned.refused(KEY)
    owned.judged(KEY, Held(Reason.APPLY_FAILED, "no"))
    assert owned.refused(KEY) and dict(owned.served()) == {KEY: UNKNOWN_ROUTE}
    owned.judged(KEY, True)
    assert not owned.refused(KEY)


def test_a_withdrawal_zeroes_the_weights_first_then_deletes_route_and_services():
    owned = _listed(OwnedObjects(OPTIONS))
    route, zeroed, services = owned.withdrawal(KEY)
    assert route == (GROUP.namespace, GROUP.route) and zeroed == GROUP.zeroed()
    assert services == [(GROUP.namespace, r.service) for r in GROUP.refs]
    owned.route_zeroed(KEY)
    assert owned.withdrawal(KEY)[1] is None  # already at 0: no second apply
    owned.route_deleted(KEY)
    for name in services:
        owned.service_deleted(KEY, name)
    owned.forget(KEY)
    assert owned.withdrawal(KEY) is None and dict(owned.served()) == {}
