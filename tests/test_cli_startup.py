"""Issue 23, point 8: the commands that need no cluster and no xDS server start without importing
the Kubernetes client or gRPC (every command took about 4 s because each imported both)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAT = ROOT / "examples" / "trafficmaps" / "chat.yaml"
HEAVY = ("kubernetes_asyncio", "grpc")

# Runs the console script's entry in a fresh interpreter, then says which heavy modules it imported.
PROBE = """
import contextlib, io, json, sys
from publisher.cli import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    code = main(json.loads(sys.argv[1]))
heavy = sorted({name.partition(".")[0] for name in sys.modules} & set(json.loads(sys.argv[2])))
print(json.dumps({"code": code, "heavy": heavy}))
"""


def run_probe(argv: list[str]) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argv), json.dumps(HEAVY)],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["--version"], 0),
        (["--help"], 0),
        (["verify", str(CHAT)], 0),
        (["verify", "--help"], 0),
        (["nginx-config", "--listen", "8080", "--control-listen", "127.0.0.1:8082", "--secret-file", str(CHAT)], None),
        (["nginx-config", "--load-modules", "--listen", "8080", "--control-listen", "127.0.0.1:8082", "--secret-file", "s"], 0),
        (["envoy-bootstrap", "--xds", "127.0.0.1:18000", "--listen", "0.0.0.0:8080"], 0),
        (["envoy-bootstrap", "--envoy-dir", "/tmp", "--listen", "0.0.0.0:8080", "--admin", "127.0.0.1:9901"], 0),
    ],
    ids=["version", "help", "verify", "verify-help", "nginx-config", "nginx-load-modules", "bootstrap-xds", "bootstrap-files"],
)
def test_commands_without_a_cluster_import_neither_the_kube_client_nor_grpc(argv, code):
    outcome = run_probe(argv)
    if code is not None:
        assert outcome["code"] == code
    assert outcome["heavy"] == []


def test_run_still_imports_what_it_needs():
    # The probe sees imports: `run --help` lists every adapter's options, the httproute adapter's
    # among them, whose module uses the Kubernetes client.
    assert "kubernetes_asyncio" in run_probe(["run", "--help"])["heavy"]
