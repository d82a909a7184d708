"""benchmarks/compare.py at tiny scale, so the script keeps working: it runs end to end, every
update it sends is confirmed, and it prints its report lines. No timing is asserted."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from tests.benchmark_scripts import load, script

SCRIPT = script("compare")


def _run(adapter: str, *extra: str) -> tuple[str, dict]:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--adapter", adapter, "--maps", "50", "--seconds", "2", "--rate", "50", *extra],
        capture_output=True, text=True, timeout=300, cwd=SCRIPT.parent.parent,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("JSON ")]
    assert len(lines) == 1, result.stdout
    return result.stdout, json.loads(lines[0][len("JSON ") :])


def _check(stdout: str, report: dict, adapter: str) -> None:
    assert report["adapter"] == adapter and report["maps"] == 50
    assert report["sent"] == 100 and report["send_failures"] == 0
    assert report["confirmed"] == report["sent"], stdout
    assert report["bare_seen"] == report["sent"], stdout
    assert report["trafficmap_bytes"] > 1000  # managedFields and all, as a real server sends them
    assert set(report["peak_rss_mb"]) >= {"sidecar", "bare watcher", "fake API"}
    for line in ("ratio publisher / bare watch", "CPU per update", "updates confirmed / sent", "maps served"):
        assert line in stdout
    if adapter in ("nginx", "nginx-lua", "envoy", "envoy-xds"):
        # What a client sees: every change answered by its new backend through the gateway.
        assert report["served"]["changes"] == report["sent"] and report["served"]["gave_up"] == 0, stdout
        assert "served through the gateway" in stdout and "after the bare watch had them" in stdout
    else:
        assert "served" not in report
    if _compare_py_spy():
        assert report["profile"]["samples"] > 0 and "longest event-loop stall" in stdout
    # Status is on: the floor of the writes the sidecar made in the churn, measured by a bare
    # client in the same run.
    floor = report["status_floor"]
    assert floor["writes"] > 0 and floor["bare_ms_per_write"] > 0, stdout
    assert floor["floor_ms_per_change"] > report["cpu_ms_per_update"]["bare watcher"] and "sidecar / that floor" in stdout


def _compare_py_spy() -> bool:
    return load("compare").py_spy() is not None


def test_json_adapter_end_to_end_at_tiny_scale():
    stdout, report = _run("json")
    _check(stdout, report, "json")


def test_report_status_mode_writes_region_reports_and_measures_their_floor():
    stdout, report = _run("json", "--status-mode", "report")
    assert report["status_mode"] == "report"
    _check(stdout, report, "json")


@pytest.mark.slow
def test_nginx_adapter_end_to_end_at_tiny_scale():
    stdout, report = _run("nginx")
    _check(stdout, report, "nginx")
    assert "nginx" in report["peak_rss_mb"]


@pytest.mark.slow
def test_nginx_lua_mode_end_to_end_at_tiny_scale():
    # Its detector reads the control listener's /table; before it, the mode stopped at launch.
    stdout, report = _run("nginx-lua")
    _check(stdout, report, "nginx-lua")
    assert "nginx" in report["peak_rss_mb"]


@pytest.mark.slow
def test_envoy_xds_mode_end_to_end_at_tiny_scale():
    # xDS serves one route configuration per map whose virtual host takes domain "*": a detector
    # matching virtual hosts by hostname saw no map served and timed out.
    stdout, report = _run("envoy-xds")
    _check(stdout, report, "envoy-xds")
    assert "envoy" in report["peak_rss_mb"]


def test_a_mode_whose_flag_the_sidecar_lacks_is_named_as_unsupported():
    compare = load("compare")
    mode = compare.Mode("future", "json", "dns", (("run", "--no-such-flag"),), compare.start_json)
    assert compare.unsupported(mode) == (
        "this sidecar does not support mode future (`ome-publisher run --help` lists no --no-such-flag)"
    )
    assert compare.unsupported(compare.MODES["json"]) is None


async def test_the_xds_relay_reaches_a_sidecar_at_once_after_it_was_down():
    """The relay's channels shared gRPC's global subchannel pool: after a failed connect, a new
    stream waited out the subchannel's reconnect backoff, so an Envoy retrying every 0.5 s reached
    a just-started sidecar up to 1.8 s late, and some first publishes measured that."""
    import grpc
    from envoy.service.discovery.v3 import discovery_pb2

    from adapters.envoy.resources import CLUSTER_TYPE, XdsRenderer
    from adapters.envoy.xds import XdsTransport
    from tests.gateways import eventually, free_port

    sidecar = f"127.0.0.1:{free_port()}"
    tap = load("compare").XdsTap(sidecar)
    await tap.start()
    first = discovery_pb2.DeltaDiscoveryRequest(type_url=CLUSTER_TYPE)
    first.node.id = "envoy-a"

    async def one_response() -> discovery_pb2.DeltaDiscoveryResponse:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{tap.port}") as channel:
            call = channel.stream_stream(tap.METHOD, request_serializer=lambda m: m.SerializeToString(),
                                         response_deserializer=discovery_pb2.DeltaDiscoveryResponse.FromString)()  # fmt: skip
            await call.write(first)
            return await asyncio.wait_for(call.read(), 10)

    transport = XdsTransport(sidecar, XdsRenderer())
    try:
        with pytest.raises(grpc.aio.AioRpcError) as down:
            await one_response()  # nothing listens there yet
        assert down.value.code() == grpc.StatusCode.UNAVAILABLE
        serving = asyncio.create_task(transport.serve())
        await asyncio.wait_for(transport.started(), 10)
        response = await one_response()  # the first try after the sidecar came up gets through
        assert response.type_url == CLUSTER_TYPE
        await tap.aclose()  # the relayed stream ends, and the sidecar lets its Envoy go
        await eventually(lambda: transport.unready() is not None and not _running("_detach"))
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
    finally:
        await transport.aclose()
        await tap.aclose()


def _running(name: str) -> bool:
    return any(task.get_coro().__name__ == name for task in asyncio.all_tasks() if not task.done())


def test_unknown_mode_is_refused_with_the_known_ones():
    result = subprocess.run([sys.executable, str(SCRIPT), "--adapter", "haproxy"], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "unknown adapter mode 'haproxy'" in result.stderr and "envoy-xds" in result.stderr


def test_flip_entries_pass_the_sidecars_checks_and_move_all_traffic_to_the_other_backend():
    """The served probe's changes: every version is a map the sidecar publishes (weights as OME
    computes them, `healthy` as it must read), its top weight is 1 + version (what the control-plane
    detectors look for), and only the backend named by the version's parity has weight."""
    from publisher.core.model import TrafficMap, parse_traffic_map
    from publisher.core.verify import verify

    compare = load("compare")
    style = "flip:7001:7002"
    for version in range(4):
        body = compare.tm_spec_body(3, "uid-3", style)
        body["spec"]["entries"] = compare.entries(3, version, style)
        body["metadata"] |= {"generation": 1, "namespace": compare.NAMESPACE}
        body["status"] = compare.tm_status_body(3, "uid-3", 1)["status"]
        tm = parse_traffic_map(body)
        assert isinstance(tm, TrafficMap), tm
        assert verify(tm) is None
        live = {entry.endpoint for entry in tm.spec.entries if entry.weight > 0}
        assert live == {f"http://127.0.0.1:{7001 if version % 2 == 0 else 7002}"}
        assert max(entry.weight for entry in tm.spec.entries) == 1 + version
        assert compare.served_probe.letter(version) == (b"A" if version % 2 == 0 else b"B")


def test_served_report_pairs_each_change_with_the_bare_watch_and_counts_the_late_ones():
    compare = load("compare")
    sent = [{"seq": seq, "stamp": 100.0 + seq} for seq in range(5)]
    bare = {seq: 100.0 + seq + 0.005 for seq in range(5)}
    served = {0: 100.010, 1: 101.020, 2: 102.300, 3: 103.095}  # change 4 never answered by its backend
    report = compare.served_report(sent, served, bare, {"requests": 40, "errors": 1, "gave_up": 1})
    assert report["changes"] == 4  # only changes both sides saw
    assert report["late"] == 1 and report["late_share"] == 0.25  # 2: 295 ms after the bare watch; 3: 90 ms is not late
    assert report["served_ms"]["max"] == 300.0 and report["bare_ms"]["max"] == 5.0
    assert (report["requests"], report["errors"], report["gave_up"]) == (40, 1, 1)
    assert report["late_at_s"] == [2.0]


def test_the_summary_over_runs_carries_the_served_numbers_and_the_stall():
    compare = load("compare")
    run = {"adapter": "nginx-lua", "maps": 10, "peak_rss_mb": {"sidecar": 1}, "served": {"served_ms": {"p99": 3.0}, "late_share": 0.01},
           "profile": {"stall": {"ms": 250.0}}}
    summary = compare.summarize([run, run | {"served": {"served_ms": {"p99": 5.0}, "late_share": 0.03}}])
    assert summary["served.served_ms.p99"] == {"median": 4.0, "min": 3.0, "max": 5.0}
    assert summary["served.late_share"]["max"] == 0.03 and summary["profile.stall.ms"]["median"] == 250.0
