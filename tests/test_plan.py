from __future__ import annotations

import pytest

from publisher.core import plan
from publisher.core.model import parse_traffic_map
from publisher.core.values import Backend, Held, Publication, Reason
from publisher.source.objects import parse_isvc
from tests.builders import make_entry, make_isvc, make_map


def pub(name: str = "chat", *weights: int, generation: int = 1) -> Publication:
    return Publication("prod", name, f"{name}.prod", generation, 1, tuple(Backend(f"c{i}", f"http://c{i}", w) for i, w in enumerate(weights)))


def test_publication_takes_the_global_host_and_sorts_backends():
    tm = parse_traffic_map(make_map(entries=[make_entry("worker-b", weight=1), make_entry("worker-a", weight=1)]))
    publication = plan.publication_for(tm, parse_isvc(make_isvc(host="chat.example.com")), "{name}.{namespace}")
    assert publication.hostname == "chat.example.com"
    assert [b.cluster for b in publication.backends] == ["worker-a", "worker-b"]
    assert publication.observed_isvc_generation == 6


def test_hostname_falls_back_to_the_template():
    tm = parse_traffic_map(make_map())
    assert plan.hostname_for(tm, parse_isvc(make_isvc(host=None)), "{name}.{namespace}.llm.internal") == "chat.prod.llm.internal"


@pytest.mark.parametrize(
    ("tm", "isvc", "withdrawn"),
    [
        (make_map(), make_isvc(), False),
        (None, make_isvc(), True),
        (make_map(metadata={"deletionTimestamp": "2026-01-01T00:00:00Z"}), make_isvc(), True),
        (make_map(), make_isvc(deletion_timestamp="2026-01-01T00:00:00Z"), True),
        (make_map(), make_isvc(enabled=False), True),
        (make_map(), make_isvc(enabled=True), False),
        (make_map(), None, False),
    ],
    ids=["current", "map-gone", "map-deleting", "isvc-deleting", "opted-out", "opted-in", "isvc-missing-is-a-gate"],
)
def test_withdrawal(tm, isvc, withdrawn):
    reason = plan.withdrawal(parse_traffic_map(tm) if tm else None, parse_isvc(isvc) if isvc else None)
    assert (reason is not None) == withdrawn


def test_held_map_keeps_its_last_publication():
    last = pub("chat", 2, 3)
    assert plan.desired_for(plan.Hold(Held(Reason.VERIFICATION_FAILED, "x")), last) is last
    assert plan.desired_for(plan.Hold(Held(Reason.VERIFICATION_FAILED, "x")), None) is None
    assert plan.desired_for(plan.Withdraw("gone"), last) is None
    assert plan.desired_for(plan.Publish(pub("chat", 1)), last) == pub("chat", 1)
