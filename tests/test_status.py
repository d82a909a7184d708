from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest

from publisher.model import Condition, Reason, validate
from publisher.status import Report, condition_for, condition_type, field_manager

NOW = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


def existing(**fields) -> Condition:
    base = {"type": "gateway-publisher.ome.io/eu", "status": "True", "reason": "Published", "message": "m",
            "observedGeneration": 3, "lastTransitionTime": "2026-01-01T00:00:00Z"}
    return validate(Condition, base | fields)


def test_names_follow_the_instance():
    assert condition_type("eu") == "gateway-publisher.ome.io/eu"
    assert field_manager("eu") == "ome-gateway-publisher-eu"


def test_new_condition_is_complete_and_valid():
    condition = condition_for(Report(True, Reason.PUBLISHED, "m", 3), "eu", None, NOW)
    assert condition == {"type": "gateway-publisher.ome.io/eu", "status": "True", "reason": "Published", "message": "m",
                         "observedGeneration": 3, "lastTransitionTime": "2026-11-30T12:00:00Z"}
    assert RFC3339.match(condition["lastTransitionTime"])


def test_same_condition_is_not_written_again():
    assert condition_for(Report(True, Reason.PUBLISHED, "m", 3), "eu", existing(), NOW) is None


@pytest.mark.parametrize(
    ("report", "moves"),
    [
        (Report(True, Reason.PUBLISHED, "other message", 3), False),
        (Report(True, Reason.PUBLISHED, "m", 4), False),
        (Report(False, Reason.VERIFICATION_FAILED, "m", 3), True),
    ],
    ids=["message", "generation", "status"],
)
def test_transition_time_moves_only_with_status(report, moves):
    condition = condition_for(report, "eu", existing(), NOW)
    assert condition is not None
    assert (condition["lastTransitionTime"] == "2026-11-30T12:00:00Z") == moves
