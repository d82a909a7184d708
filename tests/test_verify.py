"""publisher.core.verify: the map against its recomputed weights and healthy flags."""

from __future__ import annotations

import pytest

from publisher.core.values import Held, Reason
from publisher.core.verify import EntryCheck, compare, verify
from tests.builders import make_entry, valid_map


def test_the_seed_map_verifies() -> None:
    assert verify(valid_map()) is None


def test_compare_lists_every_entry_with_the_factor_in_canonical_form() -> None:
    tm = valid_map(entries=[make_entry("a", allocated=4, ready=4, weight=4), make_entry("b", allocated=2, ready=2, factor="1.5", weight=2)])
    assert compare(tm) == (
        EntryCheck("a", 4, 4, None, 4, 4, True, True),
        EntryCheck("b", 2, 2, "1500m", 2, 3, True, True),
    )
    assert [check.ok for check in compare(tm)] == [True, False]


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        pytest.param(
            [make_entry("worker-a", allocated=4, ready=4, weight=2), make_entry("worker-b", allocated=2, ready=2, factor="3", weight=2)],
            "entries[worker-b].weight is 2, recomputed 3",
            id="weight",
        ),
        pytest.param(
            [make_entry("worker-a", weight=1, healthy=False)],
            "entries[worker-a].healthy is false, recomputed true",
            id="healthy-false",
        ),
        pytest.param(
            [make_entry("worker-a", weight=1), make_entry("worker-b", ready=0, weight=0, healthy=True)],
            "entries[worker-b].healthy is true, recomputed false",
            id="healthy-true-not-ready",
        ),
        pytest.param(
            [make_entry("worker-a", weight=1, healthy=True), make_entry("worker-b", weight=0, healthy=True, gated=True)],
            "entries[worker-b].healthy is true, recomputed false",
            id="healthy-true-gated",
        ),
        pytest.param(
            [make_entry("worker-a", weight=1), make_entry("worker-b", weight=1, drain_refs=["maintenance"])],
            "entries[worker-b].weight is 1, recomputed 0",
            id="drained-weight",
        ),
        pytest.param(
            [make_entry("worker-a", weight=2, healthy=False), make_entry("worker-b", weight=1)],
            "entries[worker-a].weight is 2, recomputed 1",
            id="first-difference-weight-before-healthy",
        ),
    ],
)
def test_verification_failed(entries, message) -> None:
    assert verify(valid_map(entries=entries)) == Held(Reason.VERIFICATION_FAILED, message)


def test_an_empty_table_verifies() -> None:
    assert verify(valid_map(entries=[])) is None
    assert compare(valid_map(entries=[])) == ()
