"""benchmarks/fanout.py (issue 30, watch fan-out): its measures from known inputs, and a tiny run
with P = 2 scripted clients in both topologies, failover included, that completes and reports every
field. No timing is asserted."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from tests.benchmark_scripts import load, script

SCRIPT = script("fanout")


fanout = load("fanout")


def test_a_change_counts_from_its_stamp_to_the_last_client_that_served_it_or_later():
    sent = [{"map": 0, "version": 1, "stamp": 10.0}, {"map": 1, "version": 1, "stamp": 10.0}]
    # Client a served map 0 at weight 2 (version 1); client b skipped it for weight 3 (version 2).
    a = {(0, 2): 10.1, (1, 2): 10.2}
    b = {(0, 3): 10.5}
    latencies, lost = fanout.change_latencies(sent, [a, b])
    assert latencies == [pytest.approx(0.5)]
    assert lost == 1  # b never served map 1


def test_every_client_serves_a_weight_once_it_served_that_weight_or_a_later_one():
    class View:
        def __init__(self, first_seen):
            self.first_seen = first_seen

    views = [View({(0, 2): 1.0, (1, 3): 1.0}), View({(0, 3): 1.0, (1, 2): 1.0})]
    assert asyncio.run(fanout.serves_all(views, {0: 2, 1: 2}))
    assert not asyncio.run(fanout.serves_all(views, {0: 2, 1: 3}))


def test_per_change_divides_the_fake_counters_by_the_changes():
    before = {"events": {"ome.io/v1beta1/trafficmaps": 10}, "requests": {"watch": 4, "patch": 2, "get": 1}}
    after = {"events": {"ome.io/v1beta1/trafficmaps": 70, "ome.io/v1beta1/inferenceservices": 5},
             "requests": {"watch": 9, "patch": 22, "get": 11}}
    assert fanout.per_change(after, before, 10) == {"trafficmaps": 6.0, "inferenceservices": 0.5, "all_events": 6.5,
                                                    "requests_not_watch": 3.0}


@pytest.mark.slow
def test_a_tiny_run_in_both_topologies_reports_every_field():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--clients", "2", "--maps", "4", "--rate", "2", "--seconds", "3"],
        capture_output=True, text=True, timeout=600, cwd=SCRIPT.parent.parent,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [json.loads(line[len("JSON "):]) for line in result.stdout.splitlines() if line.startswith("JSON ")]
    assert [(r["topology"], r["clients"], r["envoy"]) for r in runs] == [("sidecar", 2, "scripted"), ("controlPlane", 2, "scripted")]
    for run in runs:
        assert run["publishers"] == 2  # P = 2: two sidecars, or the control plane's two replicas
        assert run["watches_open"]["trafficmaps"] == 2
        assert run["changes"] > 0 and run["sender_failed"] == 0 and run["changes_not_served"] == 0
        assert run["api_per_change"]["trafficmaps"] > 0
        assert set(run["change_to_last_ack_ms"]) == {"p50", "p99", "max"}
        assert run["publisher_cpu_ms_per_change"] >= 0 and run["publisher_rss_mb"] > 0
    failover = runs[1]["failover"]
    assert failover["clients_moved"] == 1 and failover["changes_lost"] == 0 and failover["moved_without_ack"] == 0
    assert failover["reconnected_all_ms"] > 0
    assert "| P | clients" in result.stdout and "failover P=2" in result.stdout
