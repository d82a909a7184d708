"""Issue 23, point 6: a running sidecar exports series only for the paths it can take (no
`source_errors_total{source="dir"}` from a kube-source sidecar, no `reloads_total` from a gateway
that never reloads, no watch or status series without the kube source) and no `_created` series.
Each case scrapes a real sidecar process."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.gateways import eventually, free_port
from tests.test_kube_integration import seed

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "trafficmaps"
P = "ome_gateway_publisher_"


async def scrape(*args: str) -> dict[str, list[dict[str, str]]]:
    """Starts `run` with `args`, waits until it is ready, and returns each sample name's label sets."""
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "publisher.cli", "run", "--listen", f"127.0.0.1:{port}", *args,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:

            async def ready() -> bool:
                try:
                    async with session.get(f"http://127.0.0.1:{port}/readyz") as response:
                        return response.status == 200
                except aiohttp.ClientError:
                    return False

            await eventually(ready, timeout=30)
            async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
                text = await response.text()
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 10)
            except TimeoutError:
                process.kill()
                await process.wait()
    samples: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample.labels)
    return samples


def no_created_series(samples: dict[str, list[dict[str, str]]]) -> None:
    assert not [name for name in samples if name.endswith("_created")]


async def test_a_kube_source_sidecar_exports_no_directory_or_reload_series(kube_api, kubeconfig, tmp_path):
    seed(kube_api)
    samples = await scrape("--kubeconfig", str(kubeconfig), "--adapter", "json", "--json-path", str(tmp_path / "out.json"))
    assert f"{P}source_errors_total" not in samples
    assert f"{P}reloads_total" not in samples
    assert {"resource": "trafficmaps", "reason": "Expired"} in samples[f"{P}watch_restarts_total"]
    assert {"result": "written"} in samples[f"{P}status_writes_total"]
    assert {"adapter": "json", "result": "published"} in samples[f"{P}publications_total"]
    no_created_series(samples)


async def test_a_directory_source_sidecar_exports_no_watch_or_status_series(tmp_path):
    samples = await scrape("--source", f"dir:{EXAMPLES}", "--adapter", "json", "--json-path", str(tmp_path / "out.json"))
    assert samples[f"{P}source_errors_total"] == [{"source": "dir"}]
    for kube_only in ("watch_restarts_total", "status_writes_total", "source_refused", "source_last_success_timestamp_seconds"):
        assert f"{P}{kube_only}" not in samples, kube_only
    assert f"{P}reloads_total" not in samples
    no_created_series(samples)


async def test_a_gateway_that_reloads_exports_its_reloads(tmp_path):
    # Envoy's file mode: each write is a file Envoy reloads (no Envoy needed to write them).
    samples = await scrape("--source", f"dir:{EXAMPLES}", "--adapter", "envoy", "--envoy-dir", str(tmp_path))
    assert {"adapter": "envoy", "result": "success"} in samples[f"{P}reloads_total"]
    no_created_series(samples)
