"""benchmarks/compare.py at tiny scale, so the script keeps working: it runs end to end, every
update it sends is confirmed, and it prints its report lines. No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "compare.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("benchmark_compare", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script loads
    spec.loader.exec_module(module)
    return module


def _run(adapter: str) -> tuple[str, dict]:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--adapter", adapter, "--maps", "50", "--seconds", "2", "--rate", "50"],
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


def test_json_adapter_end_to_end_at_tiny_scale():
    stdout, report = _run("json")
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
    compare = _load_script()
    mode = compare.Mode("future", "json", "dns", (("run", "--no-such-flag"),), compare.start_json)
    assert compare.unsupported(mode) == (
        "this sidecar does not support mode future (`ome-publisher run --help` lists no --no-such-flag)"
    )
    assert compare.unsupported(compare.MODES["json"]) is None


def test_unknown_mode_is_refused_with_the_known_ones():
    result = subprocess.run([sys.executable, str(SCRIPT), "--adapter", "haproxy"], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "unknown adapter mode 'haproxy'" in result.stderr and "envoy-xds" in result.stderr
