"""The chart's `helm test` hook (issue 23, finding 9): a Pod that checks the sidecar's /readyz and
/debug/maps through the metrics Service. Its command, as rendered, is run here against real
sidecars (the Service's URL swapped for theirs): a ready one passes, and one that is not ready (no
Envoy connected to its xDS server) and one that is not there fail, saying why."""

from __future__ import annotations

import contextlib
import http.server
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tests.builders import make_entry, make_isvc, make_map
from tests.gateways import free_port

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "ome-gateway-publisher"
HOOK = "ome-gateway-publisher/templates/tests/sidecar-test.yaml"


def _hook(changes: dict[str, Any] | None = None) -> dict[str, Any]:
    rendered = helm.Chart.load(str(CHART)).render(changes or {}, name="eu-west", namespace="ome-gateway", is_install=True)
    return yaml.safe_load(rendered[HOOK])


def test_the_hook_is_a_test_pod_asking_the_metrics_service() -> None:
    pod = _hook()
    assert pod["kind"] == "Pod" and pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    (container,) = pod["spec"]["containers"]
    assert container["command"][-1] == "http://eu-west-ome-gateway-publisher-metrics.ome-gateway.svc:9180"
    assert container["image"] == "ghcr.io/ome/ome-gateway-publisher:0.1.0"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    for version in ("1.29", "1.37"):
        kubernetes_validate.validate(pod, version, strict=True)
    assert _hook({"metrics": {"port": 9300}})["spec"]["containers"][0]["command"][-1].endswith(":9300")


def test_the_hook_asks_the_publishers_in_either_topology() -> None:
    """In the controlPlane topology (issue 30) the hook is the same Pod, and the metrics Service it
    asks selects the publisher pods only, not the Envoys'."""
    control_plane = {"topology": "controlPlane", "tls": {"allowPlaintext": True}}
    assert _hook(control_plane) == _hook()
    rendered = helm.Chart.load(str(CHART)).render(control_plane, name="eu-west", namespace="ome-gateway", is_install=True)
    objects = [doc for path, text in rendered.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]
    (service,) = [o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "eu-west-ome-gateway-publisher-metrics"]
    url = _hook(control_plane)["spec"]["containers"][0]["command"][-1]
    assert url.startswith(f"http://{service['metadata']['name']}.ome-gateway.svc:{service['spec']['ports'][0]['port']}")
    pods = {o["metadata"]["name"]: o["spec"]["template"] for o in objects if o["kind"] == "Deployment"}
    selector = service["spec"]["selector"].items()
    selected = sorted(name for name, pod in pods.items() if selector <= pod["metadata"]["labels"].items())
    assert selected == ["eu-west-ome-gateway-publisher-publisher"]
    (container,) = pods[selected[0]]["spec"]["containers"]
    assert container["name"] == "publisher" and {"name": "metrics", "containerPort": 9180, "protocol": "TCP"} in container["ports"]


def _check(url: str) -> subprocess.CompletedProcess[str]:
    command = _hook()["spec"]["containers"][0]["command"]
    assert command[:2] == ["python", "-c"]
    return subprocess.run([sys.executable, *command[1:-1], url], capture_output=True, text=True, timeout=60, check=False)


@contextlib.contextmanager
def _sidecar(tmp_path: Path, *args: str) -> Iterator[str]:
    port = free_port()
    maps = tmp_path / "maps"
    maps.mkdir(exist_ok=True)
    (maps / "chat.yaml").write_text(yaml.safe_dump_all([make_isvc(), make_map(entries=[make_entry("worker-a", weight=1)])]))
    log = (tmp_path / "sidecar.log").open("wb")
    process = subprocess.Popen([sys.executable, "-m", "publisher.cli", "run", f"--source=dir:{maps}", f"--listen=127.0.0.1:{port}", *args],
                               cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=log)  # fmt: skip
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _until_answered(url: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    for _ in range(100):  # bounded: the sidecar starts within seconds
        checked = _check(url)
        if "Connection refused" not in checked.stderr:
            return checked
    pytest.fail((tmp_path / "sidecar.log").read_text())


@pytest.mark.slow
def test_the_hook_passes_on_a_ready_sidecar(tmp_path: Path) -> None:
    with _sidecar(tmp_path, "--adapter=json", f"--json-path={tmp_path / 'out.json'}") as url:
        for _ in range(100):  # bounded: ready after its first pass
            checked = _until_answered(url, tmp_path)
            if checked.returncode == 0:
                break
        assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "/readyz: 200" in checked.stdout and "/debug/maps: 200, 1 maps {'published': 1}" in checked.stdout


@pytest.mark.slow
def test_the_hook_fails_on_a_sidecar_that_is_not_ready(tmp_path: Path) -> None:
    with _sidecar(tmp_path, "--adapter=envoy", f"--envoy-xds-listen=127.0.0.1:{free_port()}") as url:
        checked = _until_answered(url, tmp_path)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert "/readyz: 503 " in checked.stdout


def test_the_hook_fails_where_nothing_answers() -> None:
    checked = _check(f"http://127.0.0.1:{free_port()}")
    assert checked.returncode == 1 and "/readyz: [Errno 111] Connection refused" in checked.stderr


class _BecomesReady(http.server.BaseHTTPRequestHandler):
    """/readyz answers 503 once, then 200: a sidecar that became ready between two reads."""

    readyz_answers: list[int]

    def do_GET(self) -> None:  # noqa: N802 (the handler's protocol)
        if self.path == "/readyz":
            status = self.readyz_answers.pop(0) if self.readyz_answers else 200
            body = b"ok" if status == 200 else b"waiting for the first pass"
        else:
            status, body = 200, json.dumps({"maps": [{"decision": "published"}]}).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_the_hook_judges_the_readiness_it_printed() -> None:
    """It printed the first /readyz answer (503) and decided on a second read (200): a pass that
    says 503. The answer printed is the answer judged."""
    handler = type("Handler", (_BecomesReady,), {"readyz_answers": [503]})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        checked = _check(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
    assert "/readyz: 503 waiting for the first pass" in checked.stdout, checked.stdout + checked.stderr
    assert checked.returncode == 1, checked.stdout + checked.stderr
