"""benchmarks/profile_phases.py: how py-spy's samples of the sidecar become phases of a change and
its longest event-loop stall. Synthetic recordings; no timing is asserted."""

from __future__ import annotations

from tests.benchmark_scripts import load

PROJECT = "/src/checkout"


FRAMES = [
    {"name": "BaseEventLoop._run_once", "file": "/py/lib/python3.11/asyncio/base_events.py"},  # 0
    {"name": "EpollSelector.select", "file": "/py/lib/python3.11/selectors.py"},  # 1
    {"name": "Publisher.sync_once", "file": f"{PROJECT}/publisher/loop/__init__.py"},  # 2
    {"name": "render", "file": f"{PROJECT}/adapters/envoy/resources.py"},  # 3
    {"name": "Publisher.write_reports", "file": f"{PROJECT}/publisher/loop/__init__.py"},  # 4
    {"name": "Watch.__anext__", "file": "/venv/site-packages/kubernetes_asyncio/watch/watch.py"},  # 5
    {"name": "loads", "file": "/py/lib/python3.11/json/__init__.py"},  # 6
    {"name": "XdsTransport.write", "file": f"{PROJECT}/adapters/envoy/xds.py"},  # 7
    {"name": "StreamWriter.write", "file": "/py/lib/python3.11/asyncio/streams.py"},  # 8
    {"name": "parse_traffic_map", "file": f"{PROJECT}/publisher/core/model.py"},  # 9
    {"name": "KubeSource.run", "file": f"{PROJECT}/publisher/source/__init__.py"},  # 10
]
IDLE, RENDER, STATUS_DECODE, WRITE, DECODE, VALIDATE = [0, 1], [0, 2, 3], [0, 4, 5, 6], [0, 2, 7, 8], [0, 10, 5, 6], [0, 10, 9]


def _recording(samples: list[list[int]]) -> dict:
    return {"shared": {"frames": FRAMES},
            "profiles": [{"name": 'Thread 1 "MainThread"', "type": "sampled", "samples": samples, "weights": [0.01] * len(samples)}]}


def test_each_sample_lands_in_its_phase():
    phases = load("profile_phases")
    stack = lambda ids: [phases.Frame(FRAMES[i]["name"], FRAMES[i]["file"]) for i in ids]  # noqa: E731
    assert phases.is_idle(stack(IDLE)) and not phases.is_idle(stack(RENDER))
    assert phases.phase_of(stack(RENDER), project=PROJECT) == "render"  # innermost wins over the loop's decide
    assert phases.phase_of(stack(STATUS_DECODE), project=PROJECT) == "status"  # the status writer's own decoding is status
    assert phases.phase_of(stack(WRITE), project=PROJECT) == "write"  # asyncio's write is not the project's
    assert phases.phase_of(stack(DECODE), project=PROJECT) == "decode"
    assert phases.phase_of(stack(VALIDATE), project=PROJECT) == "validate"


def test_the_longest_run_of_busy_samples_is_the_stall_with_what_it_did():
    phases = load("profile_phases")
    samples = [IDLE, RENDER, IDLE, RENDER, STATUS_DECODE, STATUS_DECODE, STATUS_DECODE, IDLE, DECODE]
    result = phases.breakdown(_recording(samples), seconds=9 * 0.02, project=PROJECT)  # py-spy fell behind: 20 ms a sample
    assert result["interval_ms"] == 20.0
    stall = result["stall"]
    assert (stall["start"], stall["samples"], stall["ms"], stall["at_s"]) == (3, 4, 80.0, 0.1)
    assert stall["phases"] == {"status": 3, "render": 1}
    assert stall["frames"][0] == "Publisher.write_reports (publisher/loop/__init__.py) x3"
    assert result["busy_seconds"] == {"decode": 0.02, "render": 0.04, "status": 0.06}


def test_aiohttps_own_tasks_are_the_http_client():
    phases = load("profile_phases")
    stack = [phases.Frame("_run", f"{PROJECT}/publisher/cli/__init__.py"),
             phases.Frame("StreamWriter.write", "/venv/site-packages/aiohttp/http_writer.py")]
    assert phases.phase_of(stack, project=PROJECT) == "http client"
    assert phases.phase_of(stack[:1], project=PROJECT) == "other"
