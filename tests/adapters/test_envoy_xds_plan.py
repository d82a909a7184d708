"""adapters/envoy/xds_plan.py, purely: the plan from the target and what one Envoy holds to the
responses to send, step by step, and a property over random held states and targets: driven to
the end, the Envoy serves every map written, holds nothing of a withdrawn one, keeps every map the
engine did not name as it was, and never holds a route naming a cluster it lacks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.envoy.resources import CLUSTER_TYPE, ROUTE_TYPE, SCOPE_TYPE, MapResources, XdsRenderer, map_name, route_from_version
from adapters.envoy.xds_plan import (
    WORDS_CHARS,
    AwaitRequest,
    EnvoyState,
    Send,
    WriteAnswer,
    fleet_message,
    served_by_most,
    served_versions,
    words,
    write_outcome,
)
from adapters.envoy.xds_plan import plan as lazy_plan
from envoy.service.discovery.v3 import discovery_pb2
from publisher.core.values import Backend, MapKey, Route
from tests.adapters.xds_clients import holding

RENDERER = XdsRenderer()
CHAT, EMBED = MapKey("prod", "chat"), MapKey("prod", "embed")


def part(key: MapKey, host: str, **weights: int) -> MapResources:
    return RENDERER.render(key, Route(host, tuple(Backend(c, f"http://{c}.example:8080", w) for c, w in weights.items())))


def subscribed(state: EnvoyState, *types: str, target=()) -> EnvoyState:
    for type_url in types:
        state.receive(discovery_pb2.DeltaDiscoveryRequest(type_url=type_url), target)
    return state


def envoy_holding(*parts: MapResources, answered: bool = True) -> EnvoyState:
    """An Envoy that reconnected listing `parts`, its requests received (and its first requests
    `answered`, as after the empty answers of a start)."""
    state = EnvoyState()
    held = holding(parts)
    for type_url in (CLUSTER_TYPE, SCOPE_TYPE):
        state.receive(discovery_pb2.DeltaDiscoveryRequest(type_url=type_url, initial_resource_versions=held[type_url]), ())
    if held[SCOPE_TYPE]:
        state.receive(discovery_pb2.DeltaDiscoveryRequest(
            type_url=ROUTE_TYPE, resource_names_subscribe=sorted(held[SCOPE_TYPE]), initial_resource_versions=held[ROUTE_TYPE]), ())
    if answered:
        state.owed_first.clear()
    return state


def plan(*args, **kwargs):
    """The plan with a Send's items taken once (they are built lazily, as the pump takes them)."""
    step = lazy_plan(*args, **kwargs)
    return Send(step.type_url, tuple(step.items)) if isinstance(step, Send) else step


def names(step: Send) -> tuple[str, list[str]]:
    items = list(step.items)
    return step.type_url, [r.name for i in items for r in i.resources] + [n for i in items for n in i.removed]


def ack(state: EnvoyState, step: Send) -> None:
    """What the pump does on an ACK, and what Envoy does after one: a new scope subscribes its route."""
    items = list(step.items)
    state.owed_first.discard(step.type_url)
    state.acknowledged(step.type_url, items)
    if step.type_url == SCOPE_TYPE:
        added = [r.name for i in items for r in i.resources]
        removed = [n for i in items for n in i.removed]
        state.receive(discovery_pb2.DeltaDiscoveryRequest(type_url=ROUTE_TYPE, resource_names_subscribe=added, resource_names_unsubscribe=removed), ())


def test_a_new_envoy_gets_clusters_then_the_scope_then_the_route_once_it_subscribes_each():
    chat = part(CHAT, "chat.example.com", a=1, b=0)
    state = subscribed(EnvoyState(), CLUSTER_TYPE, target=[CHAT])
    target, keys = {CHAT: chat}, {CHAT}
    step = plan(state, target, set(), keys)
    assert isinstance(step, Send) and names(step) == (CLUSTER_TYPE, ["ome|prod|chat"])  # one cluster per map
    ack(state, step)
    assert plan(state, target, set(), keys) == AwaitRequest(SCOPE_TYPE)  # Envoy asks for scopes once its clusters are in
    subscribed(state, SCOPE_TYPE)
    step = plan(state, target, set(), keys)
    assert names(step) == (SCOPE_TYPE, ["ome|prod|chat"])
    state.owed_first.discard(SCOPE_TYPE)
    state.acknowledged(SCOPE_TYPE, list(step.items))
    assert plan(state, target, set(), keys) == AwaitRequest(ROUTE_TYPE, frozenset({CHAT}))
    state.receive(discovery_pb2.DeltaDiscoveryRequest(type_url=ROUTE_TYPE, resource_names_subscribe=["ome|prod|chat"]), ())
    step = plan(state, target, set(), keys)
    assert names(step) == (ROUTE_TYPE, ["ome|prod|chat"])
    ack(state, step)
    assert plan(state, target, set(), keys) is None
    assert state.serves(CHAT) == chat.route


def test_a_withdrawn_map_loses_its_scope_before_its_clusters():
    chat = part(CHAT, "chat.example.com", a=1)
    state = envoy_holding(chat)
    step = plan(state, {}, {CHAT}, {CHAT})
    assert names(step) == (SCOPE_TYPE, ["ome|prod|chat"])
    ack(state, step)
    step = plan(state, {}, {CHAT}, {CHAT})
    assert names(step) == (CLUSTER_TYPE, ["ome|prod|chat"])
    ack(state, step)
    assert plan(state, {}, {CHAT}, {CHAT}) is None and state.serves(CHAT) is None


def test_a_map_the_engine_neither_wrote_nor_withdrew_is_left_as_the_envoy_holds_it():
    state = envoy_holding(part(CHAT, "chat.example.com", a=1))
    assert plan(state, {}, set(), {CHAT}) is None


def test_a_weight_change_is_the_maps_cluster_alone():
    """The weights are the cluster's localities, and its version names the route."""
    state = envoy_holding(part(CHAT, "chat.example.com", a=1, b=1))
    target = {CHAT: part(CHAT, "chat.example.com", a=3, b=1)}
    step = plan(state, target, set(), {CHAT})
    assert names(step) == (CLUSTER_TYPE, ["ome|prod|chat"])
    ack(state, step)
    assert plan(state, target, set(), {CHAT}) is None and state.serves(CHAT) == target[CHAT].route


def test_a_map_going_to_503_and_back_is_served_as_each_step_is_acked():
    state = envoy_holding(part(CHAT, "chat.example.com", a=1))
    idle = {CHAT: part(CHAT, "chat.example.com", a=0)}
    step = plan(state, idle, set(), {CHAT})
    assert names(step) == (ROUTE_TYPE, ["ome|prod|chat"])  # the 503 first; the cluster goes after it
    ack(state, step)
    assert state.serves(CHAT) == idle[CHAT].route
    assert names(plan(state, idle, set(), {CHAT})) == (CLUSTER_TYPE, ["ome|prod|chat"])
    back = {CHAT: part(CHAT, "chat.example.com", a=2)}
    step = plan(state, back, set(), {CHAT})
    assert names(step) == (CLUSTER_TYPE, ["ome|prod|chat"])
    ack(state, step)
    assert state.serves(CHAT) == idle[CHAT].route  # the cluster is in, the route configuration still a 503
    step = plan(state, back, set(), {CHAT})
    assert names(step) == (ROUTE_TYPE, ["ome|prod|chat"])
    ack(state, step)
    assert state.serves(CHAT) == back[CHAT].route


def test_an_older_sidecars_cluster_per_backend_goes_once_the_route_names_the_maps_cluster():
    state = envoy_holding()
    state.hold(CLUSTER_TYPE, "ome|prod|chat|old", "1")  # what a sidecar of before one cluster per map left
    target = {CHAT: part(CHAT, "chat.example.com", a=1)}
    for _ in range(5):
        step = plan(state, target, set(), {CHAT})
        if isinstance(step, AwaitRequest):
            state.receive(discovery_pb2.DeltaDiscoveryRequest(type_url=ROUTE_TYPE, resource_names_subscribe=[map_name(CHAT)]), ())
            continue
        if names(step) == (CLUSTER_TYPE, ["ome|prod|chat|old"]):
            assert state.serves(CHAT) == target[CHAT].route  # removed only once the new route is served
            break
        ack(state, step)
    else:
        raise AssertionError("the older cluster was never removed")


def test_a_part_the_envoy_refused_is_not_planned_again_until_it_changes():
    chat = part(CHAT, "chat.example.com", a=1)
    state = envoy_holding()
    state.refused[CHAT] = (chat, "no")
    assert plan(state, {CHAT: chat}, set(), {CHAT}) is None
    changed = part(CHAT, "chat.example.com", b=1)
    assert names(plan(state, {CHAT: changed}, set(), {CHAT})) == (CLUSTER_TYPE, ["ome|prod|chat"])


def test_what_an_envoy_holds_and_refuses_as_the_target_has_it():
    old, new = part(CHAT, "chat.example.com", a=1), part(CHAT, "chat.example.com", a=2)
    state = envoy_holding(old)
    assert state.holds(CHAT, old) and not state.holds(CHAT, new) and not state.holds(CHAT, None)
    assert envoy_holding().holds(CHAT, None)
    state.refused[CHAT] = (new, "envoy e refused the route: no")
    assert state.refusal(CHAT, new) == "envoy e refused the route: no" and state.refusal(CHAT, old) is None
    assert state.refusing({CHAT: new}) == 1 and state.refusing({CHAT: old}) == 0
    # It has no vote on a map it refuses: what the others serve is what is read back.
    other = envoy_holding(new)
    assert served_by_most([state, other], {CHAT: new}) == {CHAT: new.route}
    assert served_by_most([state, other]) == {CHAT: old.route}  # a tie, before the target is known


def test_a_map_held_at_the_targets_versions_reads_back_as_the_targets_route_with_nothing_parsed():
    """A resync's read parsed every held version back into a Route (60-280 ms for 10,000 maps on
    one Envoy, the event loop's longest stall in a long churn): an Envoy holding the target's part
    serves that part's route, which is taken as it is."""
    chat, embed = part(CHAT, "chat.example.com", a=1), part(EMBED, "embed.example.com", b=2)
    state = envoy_holding(chat, embed)
    newer = part(EMBED, "embed.example.com", b=3)  # written, not yet acknowledged: it serves `embed`
    route_from_version.cache_clear()
    served = served_by_most([state], {CHAT: chat, EMBED: newer})
    assert served[CHAT] is chat.route and served[EMBED] == embed.route
    assert route_from_version.cache_info().currsize == 2  # EMBED's route configuration and cluster, read


def test_a_request_past_the_names_cap_is_named_before_anything_is_kept():
    state = subscribed(EnvoyState(), CLUSTER_TYPE)
    listed = discovery_pb2.DeltaDiscoveryRequest(type_url=SCOPE_TYPE, initial_resource_versions={f"ome|p|m{i}": "1" for i in range(11)})
    assert state.over(listed, 10) == "more than 10 scope names listed on one stream"
    assert state.over(listed, 11) is None
    routes = discovery_pb2.DeltaDiscoveryRequest(type_url=ROUTE_TYPE, resource_names_subscribe=[f"ome|p|m{i}" for i in range(6)])
    state.receive(routes, ())
    assert state.over(routes, 10) is None  # the same names again are no more names
    more = discovery_pb2.DeltaDiscoveryRequest(type_url=ROUTE_TYPE, resource_names_subscribe=[f"ome|p|n{i}" for i in range(5)])
    assert state.over(more, 10) == "more than 10 route names subscribed on one stream"


def test_a_maps_message_names_a_few_envoys_and_their_words_bounded():
    assert len(words("x" * 1000)) == WORDS_CHARS and words("one\ntwo") == "one two"
    refusals = [f"envoy e{i} refused the route: no" for i in range(5)]
    assert fleet_message(refusals, ["slow"], 2) == (
        "envoy e0 refused the route: no; envoy e1 refused the route: no; envoy e2 refused the route: no; "
        "and 3 more Envoys; held back on those; 2 other Envoys serve it")
    assert fleet_message([], ["slow"], 1) == "envoy slow has not acknowledged it (it refuses other maps); held back on those; 1 other Envoy serves it"
    assert fleet_message(refusals[:1], [], 0) == "envoy e0 refused the route: no"


def test_a_write_holds_a_map_back_on_the_envoys_that_refuse_it_while_others_serve_it():
    old, new = part(CHAT, "chat.example.com", a=1), part(CHAT, "chat.example.com", a=2)
    refuser, taker = envoy_holding(old), envoy_holding(new)
    refuser.refused[CHAT] = (new, "envoy r refused the route: no")
    answers = [WriteAnswer("r", refuser, synced=True), WriteAnswer("t", taker, synced=True)]
    assert write_outcome([CHAT], {CHAT: old}, {CHAT: new}, answers) == (
        {}, {CHAT: "envoy r refused the route: no; held back on those; 1 other Envoy serves it"})
    # None took it: rejected, for every Envoy.
    assert write_outcome([CHAT], {CHAT: old}, {CHAT: new}, answers[:1]) == ({CHAT: "envoy r refused the route: no"}, {})


def test_a_write_rejects_a_hostname_move_or_withdrawal_any_envoy_refuses():
    old, moved = part(CHAT, "chat.example.com", a=1), part(CHAT, "talk.example.com", a=1)
    refuser, taker = envoy_holding(old), envoy_holding(moved)
    refuser.refused[CHAT] = (moved, "envoy r refused the scope: taken")
    answers = [WriteAnswer("r", refuser, synced=True), WriteAnswer("t", taker, synced=True)]
    assert write_outcome([CHAT], {CHAT: old}, {CHAT: moved}, answers) == ({CHAT: "envoy r refused the scope: taken"}, {})
    refuser.refused[CHAT] = (None, "envoy r refused the scope: busy")
    assert write_outcome([CHAT], {CHAT: old}, {}, answers) == ({CHAT: "envoy r refused the scope: busy"}, {})


def test_a_write_counts_an_envoy_that_did_not_converge_as_taking_only_what_it_holds():
    old, new = part(CHAT, "chat.example.com", a=1), part(CHAT, "chat.example.com", a=2)
    embed = part(EMBED, "embed.example.com", a=1)
    slow, taker = envoy_holding(old, embed), envoy_holding(new, embed)
    answers = [WriteAnswer("slow", slow, synced=False), WriteAnswer("t", taker, synced=True)]
    # The map it holds as the target has it was taken; the one it had not answered for is pending.
    assert write_outcome([CHAT, EMBED], {CHAT: old, EMBED: None}, {CHAT: new, EMBED: embed}, answers) == (
        {}, {CHAT: "envoy slow has not acknowledged it (it refuses other maps); held back on those; 1 other Envoy serves it"})
    assert write_outcome([CHAT], {CHAT: old}, {CHAT: new}, [WriteAnswer("t", taker, synced=True)]) == ({}, {})


def test_what_each_envoy_serves_of_a_map_names_its_version_and_its_refusal():
    old, new = part(CHAT, "chat.example.com", a=1), part(CHAT, "chat.example.com", a=2)
    serving, refusing, empty = envoy_holding(new), envoy_holding(old), envoy_holding()
    refusing.refused[CHAT] = (new, "envoy r refused the route: no")
    empty.refused[CHAT] = (new, "envoy e refused the route: no")
    # The version naming what each serves (a weight change is the map's cluster alone).
    new_version, old_version = serving.served_version(CHAT), refusing.served_version(CHAT)
    assert new_version and old_version and new_version != old_version
    assert served_versions(CHAT, new, [("s", serving), ("r", refusing), ("e", empty), ("n", envoy_holding())]) == {
        "s": new_version,
        "r": f"{old_version}, holding back the current weights: envoy r refused the route: no",
        "e": "nothing, holding back the current weights: envoy e refused the route: no",
        "n": None,
    }


def test_before_the_first_write_only_the_first_requests_are_answered_empty():
    state = envoy_holding(part(CHAT, "chat.example.com", a=1), answered=False)
    step = plan(state, {}, set(), {CHAT}, seeded=False)
    assert step == Send(CLUSTER_TYPE, ())
    state.owed_first.discard(CLUSTER_TYPE)
    assert plan(state, {}, set(), {CHAT}, seeded=False) == Send(SCOPE_TYPE, ())
    state.owed_first.discard(SCOPE_TYPE)
    assert plan(state, {}, set(), {CHAT}, seeded=False) is None


def test_a_held_map_whose_route_names_its_cluster_is_served_despite_a_leftover():
    state = envoy_holding(part(CHAT, "chat.example.com", a=1))
    state.hold(CLUSTER_TYPE, "ome|prod|chat|old", "1")
    assert state.serves(CHAT) == part(CHAT, "chat.example.com", a=1).route
    state.hold(CLUSTER_TYPE, map_name(CHAT), None)
    assert state.serves(CHAT) is None


# --- a property: the plan, driven to the end ----------------------------------------------------

KEYS = [MapKey("prod", n) for n in ("a", "b", "c", "d")]
WEIGHTS = st.dictionaries(st.sampled_from(["x", "y", "z"]), st.integers(0, 3), min_size=1, max_size=3)
PARTS = st.builds(lambda k, w, h: part(k, f"{h}.example.com", **w), st.sampled_from(KEYS), WEIGHTS, st.sampled_from(["one", "two"]))


def _by_key(parts: list[MapResources]) -> dict[MapKey, MapResources]:
    return {p.key: p for p in parts}


@settings(max_examples=150, deadline=None)
@given(held=st.lists(PARTS, max_size=4), target=st.lists(PARTS, max_size=4), withdrawn=st.sets(st.sampled_from(KEYS)),
       keys=st.sets(st.sampled_from(KEYS)))
def test_driven_to_the_end_the_plan_serves_the_target_and_touches_nothing_else(held, target, withdrawn, keys):
    held_parts, target_parts = _by_key(held), _by_key(target)
    withdrawn -= target_parts.keys()
    state = envoy_holding(*held_parts.values())
    before = {k: state.serves(k) for k in KEYS}
    for _ in range(50):
        step = plan(state, target_parts, withdrawn, keys)
        if step is None:
            break
        if isinstance(step, AwaitRequest):
            assert step.type_url == ROUTE_TYPE  # every type is subscribed: only new routes await Envoy
            for key in step.keys:
                state.receive(discovery_pb2.DeltaDiscoveryRequest(type_url=ROUTE_TYPE, resource_names_subscribe=[map_name(key)]), ())
            continue
        ack(state, step)
        for key in KEYS:  # clusters first: a route Envoy holds never names a cluster it lacks
            version = state.held[ROUTE_TYPE].get(map_name(key))
            if version is not None and map_name(key) in state.held[SCOPE_TYPE]:
                assert state.serves(key) is not None
    else:
        raise AssertionError("the plan did not finish")
    for key in KEYS:
        if key in keys and key in target_parts:
            assert state.serves(key) == target_parts[key].route
            assert state.clusters_of.get(key, set()) == {r.name for r in target_parts[key].clusters}
        elif key in keys and key in withdrawn:
            assert state.serves(key) is None and key not in state.clusters_of
        else:
            assert state.serves(key) == before[key]
