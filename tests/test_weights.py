"""publisher.core.weights: SPEC section 3, every worked example and its properties."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from publisher.core.model import Entry
from publisher.core.weights import expected_healthy, factor_milli, preserves_traffic, recompute, recompute_map, routable
from tests.builders import make_condition, make_entry, valid_entry, valid_map


def entry(cluster: str, replicas: int = 1, factor: str | None = None, **kwargs: Any) -> Entry:
    kwargs.setdefault("allocated", replicas)
    kwargs.setdefault("ready", replicas)
    return valid_entry(cluster, factor=factor, **kwargs)


# SPEC §3 worked examples, then the seed's table.
EXAMPLES = [
    pytest.param([entry("a", 4), entry("b", 2)], (2, 1), id="spec-a4-b2"),
    pytest.param([entry("a", 4), entry("b", 2, "3")], (2, 3), id="spec-a4-b2-factor3"),
    pytest.param([entry("a", 4, "2"), entry("b", 2, "6")], (2, 3), id="spec-a4-factor2-b2-factor6"),
    pytest.param([entry("a", 4), entry("b", 2, "1.5")], (4, 3), id="spec-a4-b2-factor1.5"),
    pytest.param([entry("a", 3, "500m"), entry("b", 2)], (3, 4), id="spec-a3-factor500m-b2"),
    pytest.param([entry("a", 1, "1000001"), entry("b", 1)], (1_000_000, 1), id="spec-cap-a1-factor1000001-b1"),
    pytest.param([entry("a", 6), entry("b", allocated=2, ready=0), entry("c", 2)], (3, 0, 1), id="spec-b-ready0"),
    pytest.param([entry("a", allocated=7, ready=4), entry("b", 3)], (4, 3), id="spec-a-allocated7-ready4"),
    pytest.param([entry("a", 2), entry("b", 2), entry("c", 1, drain_refs=["d1"])], (2, 2, 0), id="spec-c-drained"),
    pytest.param([entry("a", allocated=7, ready=3)], (1,), id="spec-one-entry"),
    pytest.param(
        [entry("worker-a", 4), entry("worker-b", 2, "3")], (2, 3), id="seed-worker-a4-worker-b2-factor3"
    ),
]


@pytest.mark.parametrize(("entries", "weights"), EXAMPLES)
def test_worked_examples(entries: list[Entry], weights: tuple[int, ...]) -> None:
    assert recompute(entries, preserve_traffic=False) == weights


@pytest.mark.parametrize(
    ("entries", "preserve", "weights"),
    [
        pytest.param([], False, (), id="no-entries"),
        pytest.param([entry("a", 0), entry("b", 0)], False, (0, 0), id="no-replicas-all-zero"),
        pytest.param([entry("a", 2, gated=True), entry("b", 1, gated=True)], False, (0, 0), id="all-gated-drain"),
        pytest.param(
            [entry("a", 2, gated=True), entry("b", 1, gated=True)], True, (2, 1), id="all-gated-preserve-traffic"
        ),
        pytest.param(
            [entry("a", 0, gated=True), entry("b", 0)], True, (0, 0), id="preserve-needs-every-entry-gated"
        ),
        pytest.param([entry("a", 2, gated=True), entry("b", 1)], True, (0, 1), id="preserve-ignored-when-one-serves"),
        pytest.param([entry("a", 2, gated=True), entry("b", 3)], False, (0, 1), id="gated-entry-zero"),
        pytest.param([entry("a", 2, gated=False), entry("b", 3)], False, (2, 3), id="probe-passing"),
        pytest.param([entry("a", 1, "0"), entry("b", 1, "2")], False, (1, 2), id="factor-zero-counts-1"),
        pytest.param([entry("a", 1, "-3"), entry("b", 1, "2")], False, (1, 2), id="factor-negative-counts-1"),
        pytest.param([entry("a", 1, "1.2345"), entry("b", 1)], False, (247, 200), id="factor-thousandths-rounded-up"),
        pytest.param([entry("a", 1, "1n"), entry("b", 1)], False, (1, 1000), id="factor-tiny-is-one-thousandth"),
        pytest.param(
            [entry("a", 3, "1000001"), entry("b", 1), entry("c", 1, "2")],
            False,
            (1_000_000, 1, 1),
            id="cap-ceil-keeps-small-weights-positive",
        ),
        pytest.param(
            [entry("a", 1, "1M"), entry("b", 1, "1"), entry("c", 1, "1", drain_refs=["x"])],
            False,
            (1_000_000, 1, 0),
            id="cap-then-drain",
        ),
        pytest.param([entry("a", 2, drain_refs=["x"]), entry("b", 2, drain_refs=["y"])], False, (0, 0), id="all-drained"),
        pytest.param([entry("a", allocated=-2, ready=3), entry("b", 1)], False, (0, 1), id="negative-allocated-is-0"),
    ],
)
def test_edges(entries: list[Entry], preserve: bool, weights: tuple[int, ...]) -> None:
    assert recompute(entries, preserve_traffic=preserve) == weights


@pytest.mark.parametrize(
    ("kwargs", "healthy"),
    [
        pytest.param({"ready": 1}, True, id="ready"),
        pytest.param({"ready": 0}, False, id="not-ready"),
        pytest.param({"ready": 2, "allocated": 0}, True, id="ready-not-allocated"),
        pytest.param({"ready": 2, "gated": True}, False, id="gated"),
        pytest.param({"ready": 2, "gated": False}, True, id="probe-passing"),
        pytest.param({"ready": 2, "drain_refs": ["d"]}, True, id="drained-still-healthy"),
    ],
)
def test_expected_healthy(kwargs: dict[str, Any], healthy: bool) -> None:
    assert expected_healthy(valid_entry("a", **kwargs)) is healthy


def test_routable_and_factor_of_one_entry() -> None:
    one = entry("a", allocated=5, ready=3, factor="1500m")
    assert (routable(one), factor_milli(one)) == (3, 1500)
    assert factor_milli(entry("b")) == 1000


@pytest.mark.parametrize(
    ("routable_condition", "preserved"),
    [
        pytest.param(make_condition("Routable", "True", reason="AllHomesProbeFailed"), True, id="true-probe-failed"),
        pytest.param(make_condition("Routable", "False", reason="AllHomesProbeFailed"), False, id="false-policy-drain"),
        pytest.param(make_condition("Routable", "True", reason="Routable"), False, id="true-routable"),
        pytest.param(None, False, id="missing"),
    ],
)
def test_preserves_traffic(routable_condition: dict[str, Any] | None, preserved: bool) -> None:
    assert preserves_traffic(valid_map(routable=routable_condition)) is preserved


def test_recompute_map_reads_preserve_traffic_from_the_map() -> None:
    gated_entry = make_entry("a", allocated=1, ready=1, gated=True, weight=1, healthy=False)
    kept = valid_map(entries=[gated_entry], routable=make_condition("Routable", reason="AllHomesProbeFailed"))
    assert recompute_map(kept) == (1,)
    assert recompute_map(valid_map(entries=[gated_entry])) == (0,)


# --- properties, for factors that are whole thousandths ----------------------------------------------

MAX = 1_000_000
factors = st.one_of(st.none(), st.integers(min_value=1, max_value=5_000_000))
entry_specs = st.lists(
    st.tuples(st.integers(min_value=0, max_value=200), factors, st.booleans(), st.booleans()),
    min_size=1,
    max_size=8,
)


def build(specs: list[tuple[int, int | None, bool, bool]], multiplier: int = 1) -> list[Entry]:
    """(replicas, factor in thousandths or None, gated, drained) -> entries; factors times multiplier."""
    entries = []
    for index, (replicas, milli, is_gated, drained) in enumerate(specs):
        scaled = (milli if milli is not None else 1000) * multiplier
        factor = None if milli is None and multiplier == 1 else f"{scaled}m"
        entries.append(
            entry(f"c{index}", replicas, factor, gated=is_gated or None, drain_refs=["d"] if drained else None)
        )
    return entries


def raw_weights(entries: list[Entry]) -> list[int]:
    return [0 if e.probe and e.probe.gated else routable(e) * factor_milli(e) for e in entries]


def capped(raw: list[int]) -> bool:
    divisor = math.gcd(*raw)
    return divisor > 0 and max(raw) // divisor > MAX


@given(entry_specs, st.booleans())
def test_weights_are_bounded_and_positive_raw_stays_positive(specs, preserve) -> None:
    entries = build(specs)
    weights = recompute(entries, preserve_traffic=preserve)
    assert all(0 <= w <= MAX for w in weights)
    for e, raw, w in zip(entries, raw_weights(entries), weights):
        if raw > 0 and not e.drain_refs:
            assert w > 0


@given(entry_specs)
def test_gcd_is_one_unless_capped_or_drained(specs) -> None:
    entries = build(specs)
    weights = recompute(entries, preserve_traffic=False)
    if any(weights) and not capped(raw_weights(entries)) and not any(e.drain_refs for e in entries):
        assert math.gcd(*weights) == 1


@given(entry_specs, st.integers(min_value=2, max_value=1000))
def test_scaling_every_factor_changes_nothing_below_the_cap(specs, multiplier) -> None:
    entries = build(specs)
    scaled = build(specs, multiplier)
    if capped(raw_weights(scaled)):
        return
    assert recompute(scaled, preserve_traffic=False) == recompute(entries, preserve_traffic=False)


@given(entry_specs)
def test_ratios_equal_routable_times_factor_below_the_cap(specs) -> None:
    entries = build(specs)
    weights = recompute(entries, preserve_traffic=False)
    raw = raw_weights(entries)
    divisor = math.gcd(*raw)
    if divisor == 0 or capped(raw):
        return
    for e, r, w in zip(entries, raw, weights):
        assert w == (0 if e.drain_refs else r // divisor)
