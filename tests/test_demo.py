"""publisher.cli.demo: the maps it writes pass every gate, its built-in example matches the shipped one,
its judgement of a split, and the whole demo against a real Envoy, leaving nothing running."""

from __future__ import annotations

import asyncio
import contextlib
import re
from pathlib import Path

import pytest

from publisher.cli import demo
from publisher.core.gate import GateOptions, decide
from publisher.source.manifests import read_manifests
from publisher.core.model import INFERENCE_SERVICE_KIND, TrafficMap, parse_traffic_map
from publisher.core.values import Backend, Publication
from publisher.source.objects import parse_isvc

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "trafficmaps" / "chat.yaml"


def example() -> list[dict]:
    return read_manifests(EXAMPLE)


def test_the_demo_reads_the_shipped_example() -> None:
    assert demo.EXAMPLE.resolve() == EXAMPLE.resolve()


@pytest.mark.parametrize(
    ("ready", "weights", "healthy", "message"),
    [(0, (1, 0), (True, False), "1 of 2 homes routable"), (1, (4, 3), (True, True), "2 of 2 homes routable")],
    ids=["worker-b-ready-0", "worker-b-ready-1"],
)
def test_change_ready_writes_the_next_generation_that_passes_every_gate(ready, weights, healthy, message) -> None:
    shipped = example()
    objects = demo.change_ready(shipped, demo.CHAT, "worker-b", ready)
    (raw_isvc,) = [o for o in objects if o["kind"] == INFERENCE_SERVICE_KIND]
    (raw_map,) = [o for o in objects if o["kind"] == "TrafficMap"]
    tm = parse_traffic_map(raw_map)
    assert isinstance(tm, TrafficMap)
    assert decide(tm, parse_isvc(raw_isvc), GateOptions()) is None
    assert tm.metadata.generation == 4
    assert tuple(e.weight for e in tm.spec.entries) == weights
    assert tuple(e.healthy for e in tm.spec.entries) == healthy
    assert tm.status.condition("Routable").message == message
    assert ("ready" in raw_map["spec"]["entries"][1]["capacity"]) == bool(ready)  # OME omits a zero
    assert shipped == example()  # the input is left as it was


def test_point_at_changes_only_the_named_endpoints() -> None:
    objects = demo.point_at(example(), demo.CHAT, {"worker-b": "http://127.0.0.1:9"})
    entries = objects[1]["spec"]["entries"]
    assert [e["endpoint"] for e in entries] == ["http://chat.prod.worker-a.example.com", "http://127.0.0.1:9"]


def pub(*weights: int) -> Publication:
    backends = tuple(Backend(f"worker-{c}", f"http://127.0.0.1:{i + 1}", w) for i, (c, w) in enumerate(zip("ab", weights)))
    return Publication("prod", "chat", "chat.example.com", 3, 6, backends)


@pytest.mark.parametrize(
    ("weights", "counts", "expected"),
    [
        ((2, 3), {"worker-a": 449, "worker-b": 551}, True),
        ((2, 3), {"worker-a": 451, "worker-b": 549}, False),
        ((1, 0), {"worker-a": 1000}, True),
        ((1, 0), {"worker-a": 999, "worker-b": 1}, False),
        ((2, 3), {"worker-a": 400, "worker-b": 599, "status:503": 1}, False),
    ],
    ids=["within-tolerance", "past-tolerance", "weight-0-empty", "weight-0-hit", "a-failed-request"],
)
def test_within(weights, counts, expected) -> None:
    assert demo._within(pub(*weights), counts, 1000) is expected


def test_table_lists_failed_requests_below_the_clusters() -> None:
    lines = demo._table(pub(2, 3), {"worker-a": 400, "worker-b": 599, "status:503": 1}, 1000)
    assert lines[1].split() == ["worker-a", "2", "40.0%", "40.0%", "400"]
    assert lines[3].split() == ["status:503", "0.1%", "1"]


async def refused(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return True
    writer.close()
    await writer.wait_closed()
    return False


@pytest.mark.slow
async def test_demo_follows_the_change_and_leaves_nothing_running(monkeypatch) -> None:
    started = []
    real_run_envoy = demo.run_envoy

    @contextlib.asynccontextmanager
    async def recording_run_envoy(bootstrap_path, **kwargs):
        async with real_run_envoy(bootstrap_path, **kwargs) as envoy:
            started.append((envoy.process, bootstrap_path))
            yield envoy

    monkeypatch.setattr(demo, "run_envoy", recording_run_envoy)
    lines: list[str] = []
    # 2,000 requests a phase: a 40% share missing by 5 points is then a 4.5-sigma event (at 1,000,
    # about one run in 800 would fail by chance).
    assert await demo.run_demo(lines.append, requests=2000) is True

    text = "\n".join(lines)
    assert "phase 1" in text and "phase 2" in text and "changing worker-b's ready replicas 2 -> 0" in text
    phase_2 = text.index("phase 2")
    assert re.search(r"worker-a\s+2\s+40\.0%", text[:phase_2]) and re.search(r"worker-b\s+3\s+60\.0%", text[:phase_2])
    assert re.search(r"worker-a\s+1\s+100\.0%\s+100\.0%", text[phase_2:])
    assert re.search(r"worker-b\s+0\s+0\.0%\s+0\.0%\s+0$", text[phase_2:], re.MULTILINE)
    # Envoy's own count of each phase, from its Load Reporting Service, is every request sent.
    first_count, second_count = re.findall(r"Envoy's own count \(Load Reporting Service\), (\d+) requests: (.*)", text)
    assert first_count[0] == second_count[0] == "2000"
    assert re.fullmatch(r"worker-a \d+ \(\d+\.\d%\), worker-b \d+ \(\d+\.\d%\)", first_count[1])
    assert second_count[1] == "worker-a 2000 (100.0%), worker-b 0 (0.0%)"

    ((process, bootstrap_path),) = started
    assert process.returncode is not None, "envoy still running"
    assert not bootstrap_path.parent.exists(), "temporary directory left behind"
    ports = [int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", lines[0])]
    assert len(ports) == 4  # two backends, the sidecar's xDS server and Envoy's listener
    for port in ports:
        assert await refused(port), f"something still listens on {port}"
