"""publisher.core.gate: each SPEC §4 gate, its order, and the three Published-gate modes."""

from __future__ import annotations

from typing import Any

import pytest

from publisher.core.gate import GateOptions, PublishedGate, decide
from publisher.core.model import InvalidObject, parse_traffic_map
from publisher.core.values import Held, Reason
from tests.builders import make_condition, make_entry, make_map, valid_isvc

AUTO, REQUIRE, IGNORE = PublishedGate.AUTO, PublishedGate.REQUIRE, PublishedGate.IGNORE
OTHER_UID = "0f0f0f0f-0000-4000-8000-000000000000"


def held(raw: dict[str, Any], isvc: Any = "default", options: GateOptions = GateOptions()) -> Held | None:
    item = parse_traffic_map(raw)
    return decide(item, valid_isvc() if isvc == "default" else isvc, options)


def published(status: str = "True", *, reason: str | None = None, generation: int = 3, **kwargs: Any) -> dict:
    return make_condition("Published", status, reason=reason, observed_generation=generation, **kwargs)


def test_a_valid_map_passes() -> None:
    assert held(make_map()) is None


def test_invalid_map_names_the_entry_by_cluster() -> None:
    raw = make_map(entries=[make_entry("worker-a", weight=2, allocated=4, ready=4), make_entry("worker-b", weight=-1)])
    result = held(raw)
    assert result is not None
    assert result.reason is Reason.INVALID_MAP
    assert "spec.entries[worker-b].weight" in result.message and "-1" in result.message


def test_invalid_map_keeps_the_index_when_the_cluster_is_unusable() -> None:
    item = parse_traffic_map(make_map(entries=[make_entry("a;b", endpoint="http://x.example.com")]))
    assert isinstance(item, InvalidObject)
    result = decide(item, None, GateOptions())
    assert result == Held(Reason.INVALID_MAP, "spec.entries[0].cluster: 'a;b' is not a DNS-1123 subdomain (got 'a;b')")


def test_invalid_map_comes_before_every_other_gate() -> None:
    raw = make_map(entries=[make_entry("worker-a", weight="2")], routable=None, observed_isvc_generation=1)
    assert held(raw, isvc=None).reason is Reason.INVALID_MAP


def test_source_missing() -> None:
    assert held(make_map(), isvc=None) == Held(
        Reason.SOURCE_MISSING, "InferenceService prod/chat (spec.service) not found"
    )


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        pytest.param(
            make_map(status={"sourceUID": ""}),
            "status.sourceUID is empty, InferenceService prod/chat has uid 5d3c6f2e-8a41-4b7e-9c2d-1f0e6a7b8c90",
            id="source-uid-empty",
        ),
        pytest.param(
            make_map(status={"sourceUID": None}),
            "status.sourceUID is empty, InferenceService prod/chat has uid 5d3c6f2e-8a41-4b7e-9c2d-1f0e6a7b8c90",
            id="source-uid-missing",
        ),
        pytest.param(
            make_map(status={"sourceUID": OTHER_UID}),
            f"status.sourceUID is {OTHER_UID}, InferenceService prod/chat has uid 5d3c6f2e-8a41-4b7e-9c2d-1f0e6a7b8c90",
            id="source-uid-other",
        ),
        pytest.param(
            make_map(metadata={"ownerReferences": [
                {"apiVersion": "ome.io/v1beta1", "kind": "InferenceService", "name": "chat", "uid": OTHER_UID,
                 "controller": True}
            ]}),
            f"metadata.ownerReferences[chat].uid is {OTHER_UID}, "
            "InferenceService prod/chat has uid 5d3c6f2e-8a41-4b7e-9c2d-1f0e6a7b8c90",
            id="controller-owner-other-uid",
        ),
    ],
)
def test_source_uid_mismatch(raw: dict[str, Any], message: str) -> None:
    assert held(raw) == Held(Reason.SOURCE_UID_MISMATCH, message)


@pytest.mark.parametrize(
    "owner",
    [
        pytest.param({"kind": "InferenceService", "uid": OTHER_UID, "controller": False}, id="not-controller"),
        pytest.param({"kind": "Deployment", "uid": OTHER_UID, "controller": True}, id="other-kind"),
    ],
)
def test_other_owner_references_do_not_hold(owner: dict[str, Any]) -> None:
    assert held(make_map(metadata={"ownerReferences": [dict(owner, apiVersion="v1", name="x")]})) is None


def test_no_owner_reference_is_tolerated() -> None:
    assert held(make_map(metadata={"ownerReferences": None})) is None


def test_isvc_generation_mismatch() -> None:
    assert held(make_map(observed_isvc_generation=5)) == Held(
        Reason.ISVC_GENERATION_MISMATCH,
        "spec.observedISVCGeneration is 5, InferenceService prod/chat metadata.generation is 6",
    )


def test_source_unknown_skips_the_source_gates() -> None:
    raw = make_map(observed_isvc_generation=5, status={"sourceUID": OTHER_UID})
    assert held(raw, isvc=None, options=GateOptions(source_known=False)) is None


@pytest.mark.parametrize(
    ("routable", "message"),
    [
        pytest.param(None, "status.conditions[Routable] is missing, metadata.generation is 3", id="missing"),
        pytest.param(
            make_condition("Routable", observed_generation=2),
            "status.conditions[Routable].observedGeneration is 2, metadata.generation is 3",
            id="older",
        ),
        pytest.param(
            make_condition("Routable", observed_generation=None),
            "status.conditions[Routable].observedGeneration is unset, metadata.generation is 3",
            id="unset",
        ),
    ],
)
def test_routable_outdated(routable: dict[str, Any] | None, message: str) -> None:
    assert held(make_map(routable=routable)) == Held(Reason.ROUTABLE_OUTDATED, message)


def test_routable_false_but_current_passes() -> None:
    entries = [make_entry("worker-a", ready=0, allocated=0, weight=0, healthy=False)]
    assert held(make_map(entries=entries, routable=make_condition("Routable", "False", reason="AllHomesUnready"))) is None


# The Published gate: (condition, observedTrafficMapGeneration) -> outcome under auto, require, ignore.
CURRENT = "current"
PUBLISHED_CASES = [
    pytest.param(None, None, (None, Reason.NOT_PUBLISHED_BY_OME, None), id="no-condition"),
    pytest.param(published(), 3, (None, None, None), id="true-current"),
    pytest.param(published("False", reason="Withdrawn"), None, (None, Reason.NOT_PUBLISHED_BY_OME, None), id="withdrawn"),
    pytest.param(
        published("False", reason="Transitioning"), 3, (Reason.NOT_PUBLISHED_BY_OME,) * 2 + (None,), id="transitioning"
    ),
    pytest.param(
        published("False", reason="ApplyFailed"), 3, (Reason.NOT_PUBLISHED_BY_OME,) * 2 + (None,), id="apply-failed"
    ),
    pytest.param(
        published("False", reason="InvalidOwner"), 2, (Reason.NOT_PUBLISHED_BY_OME,) * 2 + (None,), id="invalid-owner"
    ),
    pytest.param(published(generation=2), 3, (Reason.NOT_PUBLISHED_BY_OME,) * 2 + (None,), id="true-older-condition"),
    pytest.param(published(), 2, (Reason.NOT_PUBLISHED_BY_OME,) * 2 + (None,), id="true-older-map-generation"),
    pytest.param(published(), None, (Reason.NOT_PUBLISHED_BY_OME,) * 2 + (None,), id="true-map-generation-unset"),
    pytest.param(published("Unknown"), 3, (Reason.NOT_PUBLISHED_BY_OME,) * 2 + (None,), id="unknown"),
]


@pytest.mark.parametrize(("condition", "observed_map_generation", "outcomes"), PUBLISHED_CASES)
@pytest.mark.parametrize("mode", [AUTO, REQUIRE, IGNORE], ids=str)
def test_published_gate(condition, observed_map_generation, outcomes, mode) -> None:
    raw = make_map(published=condition, observed_traffic_map_generation=observed_map_generation)
    result = held(raw, options=GateOptions(published_gate=mode))
    expected = outcomes[[AUTO, REQUIRE, IGNORE].index(mode)]
    assert (result.reason if result else None) == expected


@pytest.mark.parametrize(
    ("condition", "observed_map_generation", "mode", "message"),
    [
        pytest.param(
            published("False", reason="ApplyFailed", message="gateway refused"),
            3,
            AUTO,
            "status.conditions[Published] is False with reason ApplyFailed: gateway refused",
            id="names-ome-reason",
        ),
        pytest.param(
            published(generation=2),
            2,
            AUTO,
            "status.conditions[Published].observedGeneration is 2 and "
            "status.observedTrafficMapGeneration is 2, metadata.generation is 3",
            id="older-generation",
        ),
        pytest.param(
            None,
            None,
            REQUIRE,
            "status.conditions[Published] is missing, --ome-published-gate=require needs it True at generation 3",
            id="require-missing",
        ),
    ],
)
def test_not_published_messages(condition, observed_map_generation, mode, message) -> None:
    raw = make_map(published=condition, observed_traffic_map_generation=observed_map_generation)
    assert held(raw, options=GateOptions(published_gate=mode)) == Held(Reason.NOT_PUBLISHED_BY_OME, message)


def test_verification_failed() -> None:
    entries = [make_entry("worker-a", allocated=4, ready=4, weight=2), make_entry("worker-b", allocated=2, ready=2, factor="3", weight=2)]
    assert held(make_map(entries=entries)) == Held(
        Reason.VERIFICATION_FAILED, "entries[worker-b].weight is 2, recomputed 3"
    )


@pytest.mark.parametrize(
    ("raw", "isvc", "reason"),
    [
        pytest.param(
            make_map(status={"sourceUID": OTHER_UID}, observed_isvc_generation=1), "default",
            Reason.SOURCE_UID_MISMATCH, id="uid-before-generation",
        ),
        pytest.param(make_map(observed_isvc_generation=1, routable=None), "default", Reason.ISVC_GENERATION_MISMATCH,
                     id="generation-before-routable"),
        pytest.param(make_map(routable=None, published=published("False", reason="ApplyFailed")), "default",
                     Reason.ROUTABLE_OUTDATED, id="routable-before-published"),
        pytest.param(
            make_map(published=published("False", reason="ApplyFailed"), entries=[make_entry("worker-a", weight=7)]),
            "default", Reason.NOT_PUBLISHED_BY_OME, id="published-before-verification",
        ),
        pytest.param(make_map(routable=None), None, Reason.SOURCE_MISSING, id="missing-source-first"),
    ],
)
def test_gate_order(raw: dict[str, Any], isvc: Any, reason: Reason) -> None:
    result = held(raw, isvc=isvc)
    assert result is not None and result.reason is reason


def test_stalled_prober_is_reported_without_a_ticking_age() -> None:
    from datetime import UTC, datetime

    from publisher.core.gate import stalled_probes

    entries = [
        make_entry("worker-a", weight=1, probe={"result": "Passing", "gated": False, "lastProbeTime": "2026-11-30T11:58:00Z"}),
        make_entry("worker-b", weight=1, probe={"result": "Passing", "gated": False, "lastProbeTime": "2026-11-30T11:59:50Z"}),
    ]
    tm = parse_traffic_map(make_map(entries=entries))
    now = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
    assert stalled_probes(tm, 60, now) == "probe results older than 60s for worker-a"
    assert stalled_probes(tm, 600, now) is None
