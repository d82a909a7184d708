"""`ome-publisher run` as a user runs it: in-process for exit codes and output, and as a real
process for the HTTP endpoints and for a kill -9 in the middle of writes."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import aiohttp
import yaml

from publisher.cli import main
from tests.builders import make_entry, make_isvc, make_map
from tests.gateways import eventually, free_port

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_once_publishes_the_examples(tmp_path, capsys):
    out = tmp_path / "out.json"
    code = main(["run", "--source", f"dir:{EXAMPLES / 'trafficmaps'}", "--adapter", "json", "--json-path", str(out), "--once"])
    assert code == 0
    document = json.loads(out.read_text())
    assert {p["name"]: [b["weight"] for b in p["backends"]] for p in document["publications"]} == {"chat": [2, 3], "embed": [2, 2, 0]}
    assert "published 2 map(s)" in capsys.readouterr().out


def test_once_exits_1_when_a_map_is_held(tmp_path, capsys):
    maps = tmp_path / "maps"
    maps.mkdir()
    shutil.copy(EXAMPLES / "held" / "chat-wrong-weights.yaml", maps)
    code = main(["run", "--source", f"dir:{maps}", "--adapter", "json", "--json-path", str(tmp_path / "o.json"), "--once"])
    assert code == 1
    assert "VerificationFailed" in capsys.readouterr().out


def test_dry_run_prints_one_json_document_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out.json"
    code = main(["run", "--source", f"dir:{EXAMPLES / 'trafficmaps'}", "--adapter", "json", "--json-path", str(out),
                 "--dry-run", "--output", "json"])
    assert code == 0
    document = json.loads(capsys.readouterr().out)
    assert set(document) == {"publications", "held"}
    assert [p["name"] for p in document["publications"]] == ["chat", "embed"]
    assert not out.exists()


def test_a_dry_run_plan_never_gives_one_hostname_to_two_maps(tmp_path, capsys):
    """Issue 27, item 14: with prod/chat and staging/chat on one hostname the plan gave it to both,
    while `run --once` holds one HostConflict. The plan holds the same one: here staging/chat, the
    older TrafficMap (ahead of namespace order), as the sidecar's engine decides."""
    maps = tmp_path / "maps"
    maps.mkdir()
    for namespace, created in (("prod", "2026-03-01T00:00:00Z"), ("staging", "2026-01-01T00:00:00Z")):
        (maps / f"{namespace}.yaml").write_text(yaml.safe_dump_all([
            make_isvc("chat", namespace), make_map("chat", namespace, metadata={"creationTimestamp": created})]))
    common = ["run", "--source", f"dir:{maps}", "--adapter", "json", "--json-path", str(tmp_path / "out.json")]
    assert main([*common, "--dry-run", "--output", "json"]) == 1
    plan = json.loads(capsys.readouterr().out)
    assert [(p["namespace"], p["hostname"]) for p in plan["publications"]] == [("staging", "chat.example.com")]
    assert [(h["namespace"], h["reason"]) for h in plan["held"]] == [("prod", "HostConflict")]
    assert "staging/chat" in plan["held"][0]["message"]
    assert main([*common, "--dry-run"]) == 1
    assert "  prod/chat HostConflict: hostname chat.example.com is already served for staging/chat" in capsys.readouterr().out
    # What the plan says is what one pass of the sidecar does.
    assert main([*common, "--once", "--output", "json"]) == 1
    assert json.loads(capsys.readouterr().out) == plan


def test_environment_sets_options(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out.json"
    monkeypatch.setenv("OME_PUBLISHER_JSON_PATH", str(out))
    monkeypatch.setenv("OME_PUBLISHER_ADAPTER", "json")
    assert main(["run", "--source", f"dir:{EXAMPLES / 'trafficmaps'}", "--once"]) == 0
    assert out.exists()


def test_bad_options_exit_2_naming_the_option(tmp_path, capsys):
    assert main(["run", "--source", "s3://x", "--once"]) == 2
    assert "--source" in capsys.readouterr().err
    assert main(["run", "--source", f"dir:{tmp_path}", "--adapter", "json", "--once"]) == 2
    assert "--json-path" in capsys.readouterr().err
    assert main(["run", "--source", f"dir:{tmp_path / 'missing'}", "--json-path", str(tmp_path / "o"), "--once"]) == 2
    assert "not a directory" in capsys.readouterr().err


def write_maps(directory: Path, count: int, ready: int) -> None:
    documents = []
    for i in range(count):
        name = f"m{i:03d}"
        documents.append(make_isvc(name))
        documents.append(make_map(name, entries=[make_entry("worker-a", allocated=ready, ready=ready, weight=1, service=name)]))
    tmp = directory / ".maps.tmp"
    tmp.write_text(yaml.safe_dump_all(documents))
    os.replace(tmp, directory / "maps.yaml")


async def start_run(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "publisher.cli", "run", *args,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )


async def stop(process: asyncio.subprocess.Process, sig: int = signal.SIGTERM) -> None:
    if process.returncode is None:
        process.send_signal(sig)
        try:
            await asyncio.wait_for(process.wait(), 10)
        except TimeoutError:
            process.kill()
            await process.wait()


async def test_kill_9_mid_run_leaves_a_complete_json_file(tmp_path):
    maps = tmp_path / "maps"
    maps.mkdir()
    out = tmp_path / "out.json"
    write_maps(maps, 200, 1)
    process = await start_run("--source", f"dir:{maps}", "--adapter", "json", "--json-path", str(out),
                              "--listen", f"127.0.0.1:{free_port()}")
    try:
        await eventually(lambda: out.exists(), timeout=30)
        for ready in range(2, 12):
            write_maps(maps, 200, ready)
            await asyncio.sleep(0.1)
    finally:
        await stop(process, signal.SIGKILL)
    document = json.loads(out.read_text())
    assert len(document["publications"]) == 200


async def test_http_endpoints_of_a_running_sidecar(tmp_path):
    port = free_port()
    out = tmp_path / "out.json"
    process = await start_run("--source", f"dir:{EXAMPLES / 'trafficmaps'}", "--adapter", "json", "--json-path", str(out),
                              "--listen", f"127.0.0.1:{port}", "--metrics-per-map", "all")
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:

            async def status(path: str) -> int:
                try:
                    async with session.get(base + path) as response:
                        return response.status
                except aiohttp.ClientError:
                    return 0

            await eventually(lambda: status("/readyz"), timeout=30)
            await eventually(lambda: _is(status("/readyz"), 200), timeout=30)
            assert await status("/healthz") == 200
            async with session.get(base + "/debug/maps") as response:
                maps = {m["name"]: m for m in (await response.json())["maps"]}
            assert maps["chat"]["decision"] == "published" and maps["chat"]["weights"] == {"worker-a": 2, "worker-b": 3}
            async with session.get(base + "/metrics") as response:
                text = await response.text()
    finally:
        await stop(process)
    for needle in (
        'ome_gateway_publisher_publications_total{adapter="json",result="published"}',
        "ome_gateway_publisher_apply_duration_seconds_bucket",
        "ome_gateway_publisher_event_to_apply_seconds_bucket",
        'ome_gateway_publisher_maps{state="published"} 2.0',
        'ome_gateway_publisher_weight{cluster="worker-b",name="chat",namespace="prod"} 3.0',
        'ome_gateway_publisher_last_success_timestamp_seconds{adapter="json"}',
        "ome_gateway_publisher_build_info{version=",
    ):
        assert needle in text, needle
    for declared in ("verification_failures_total", "watch_restarts_total", "reloads_total", "map_held"):
        assert f"# TYPE ome_gateway_publisher_{declared.removesuffix('_total')}" in text, declared


async def _is(awaitable, value) -> bool:
    return await awaitable == value


def test_demo_refuses_too_few_requests(capsys):
    assert main(["demo", "--requests", "10"]) == 2
    assert "--requests" in capsys.readouterr().err


async def test_sigterm_stops_the_sidecar_cleanly(tmp_path):
    port = free_port()
    process = await start_run("--source", f"dir:{EXAMPLES / 'trafficmaps'}", "--adapter", "json",
                              "--json-path", str(tmp_path / "out.json"), "--listen", f"127.0.0.1:{port}")
    try:
        await eventually(lambda: (tmp_path / "out.json").exists(), timeout=30)
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 10) == 0
    finally:
        await stop(process, signal.SIGKILL)
