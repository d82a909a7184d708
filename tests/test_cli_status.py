"""`ome-publisher status` against the fake API server over real HTTP: a 5-region fleet, regions in
both status modes, some behind; exit codes 0/1/2 as `verify`'s; --wait-published; --forget-region."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from publisher.cli import app
from publisher.cli import main
from publisher.cli.config import RunConfig
from tests.builders import make_isvc, make_map
from tests.fakes.kube_api import FakeKubeAPI

TM = "ome.io/v1beta1/trafficmaps"
ISVC = "ome.io/v1beta1/inferenceservices"
RR = "gateway-publisher.ome.io/v1alpha1/regionreports"
# Two regions in condition mode, three in report mode.
MODES = {"region-0": "condition", "region-1": "condition", "region-2": "report", "region-3": "report", "region-4": "report"}


def seed(api: FakeKubeAPI, name: str, namespace: str = "prod") -> None:
    isvc = api.create(make_isvc(name, namespace=namespace))
    api.create(make_map(name, namespace=namespace, generation=1, isvc_uid=isvc["metadata"]["uid"], observed_isvc_generation=1))


def bump(api: FakeKubeAPI, name: str, namespace: str = "prod") -> int:
    """OME changes the map (a new generation) and, as its routing controller does, marks it Routable."""
    current = api.get(TM, namespace, name)
    current["spec"]["entries"][0]["probe"] = {"result": "Passed"}  # any spec change moves the generation
    stored = api.update(current)
    generation = stored["metadata"]["generation"]
    for condition in stored["status"]["conditions"]:
        if condition["type"] in ("Routable", "Published"):
            condition["observedGeneration"] = generation
    stored["status"]["observedTrafficMapGeneration"] = generation
    api.update(stored)
    return generation


async def sidecar_pass(kubeconfig: Path, tmp_path: Path, region: str) -> None:
    """One full pass of region `region`'s sidecar, in its status mode."""
    config = RunConfig(kubeconfig=kubeconfig, adapter="json", json_path=tmp_path / f"{region}.json", once=True,
                       region=region, status_mode=MODES[region])
    await app.run(config)


async def status(capsys: pytest.CaptureFixture[str], kubeconfig: Path, *argv: str) -> tuple[int, str, str]:
    """`ome-publisher status` (in a thread: it runs its own event loop, the fake runs in ours)."""
    code = await asyncio.to_thread(main, ["status", "--kubeconfig", str(kubeconfig), *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def regions_of(document: dict[str, Any], name: str) -> dict[str, tuple[Any, ...]]:
    item = next(m for m in document["maps"] if m["name"] == name)
    return {r["region"]: (r["mode"], r["observedGeneration"], r["status"], r["reason"], r["published"]) for r in item["regions"]}


async def test_a_five_region_fleet_in_both_modes_some_behind(kube_api, kubeconfig, tmp_path, capsys):
    seed(kube_api, "chat")
    seed(kube_api, "embed")
    # The five regions write at once; none overwrites another's verdict.
    await asyncio.gather(*(sidecar_pass(kubeconfig, tmp_path, region) for region in MODES))
    code, out, err = await status(capsys, kubeconfig, "-o", "json")
    assert code == 0, err
    document = json.loads(out)
    assert document["published"] is True
    assert regions_of(document, "chat") == {region: (mode, 1, "True", "Published", True) for region, mode in MODES.items()}
    # The report-mode regions wrote RegionReports and no condition; the others only conditions.
    assert sorted(o["region"] for o in kube_api.objects(RR)) == ["region-2", "region-3", "region-4"]
    types = {c["type"] for c in kube_api.get(TM, "prod", "chat")["status"]["conditions"]}
    assert {t for t in types if t.startswith("gateway-publisher")} == {"gateway-publisher.ome.io/region-0", "gateway-publisher.ome.io/region-1"}

    # OME changes chat; only region-0 (condition) and region-3 (report) have caught up.
    generation = bump(kube_api, "chat")
    for region in ("region-0", "region-3"):
        await sidecar_pass(kubeconfig, tmp_path, region)
    code, out, err = await status(capsys, kubeconfig, "-o", "json")
    assert code == 1, err
    document = json.loads(out)
    assert document["published"] is False
    assert regions_of(document, "chat") == {
        "region-0": ("condition", generation, "True", "Published", True),
        "region-1": ("condition", 1, "True", "Published", False),
        "region-2": ("report", 1, "True", "Published", False),
        "region-3": ("report", generation, "True", "Published", True),
        "region-4": ("report", 1, "True", "Published", False),
    }
    assert next(m for m in document["maps"] if m["name"] == "embed")["published"] is True
    # One map by name: embed is published everywhere, so 0.
    code, out, _ = await status(capsys, kubeconfig, "embed")
    assert code == 0 and "prod/embed generation 1: published in all 5 regions" in out and "chat" not in out
    # The table says who is behind.
    code, out, _ = await status(capsys, kubeconfig, "chat")
    assert code == 1
    assert f"prod/chat generation {generation}: published in 2 of 5 regions; not in region-1, region-2, region-4" in out
    rows = [line.split() for line in out.splitlines()]
    assert ["REGION", "MODE", "OBSERVED", "STATUS", "REASON", "SINCE"] in rows
    assert ["region-1", "condition", "1", "True", "Published"] == rows[3][:5]
    assert ["region-3", "report", str(generation), "True", "Published"] == rows[5][:5]
    code, out, _ = await status(capsys, kubeconfig, "-o", "yaml", "chat")
    assert code == 1 and yaml.safe_load(out)["maps"][0]["generation"] == generation


async def test_a_held_region_and_a_region_that_never_reported(kube_api, kubeconfig, tmp_path, capsys):
    seed(kube_api, "chat")
    for region in ("region-0", "region-2"):
        await sidecar_pass(kubeconfig, tmp_path, region)
    # The InferenceService goes away: every region that runs now holds the map.
    kube_api.delete(ISVC, "prod", "chat")
    await sidecar_pass(kubeconfig, tmp_path, "region-3")
    code, out, _ = await status(capsys, kubeconfig, "-o", "json", "--region", "region-4")
    assert code == 1
    assert regions_of(json.loads(out), "chat") == {
        "region-0": ("condition", 1, "True", "Published", True),
        "region-2": ("report", 1, "True", "Published", True),
        "region-3": ("report", 1, "False", "SourceMissing", False),
        "region-4": (None, None, None, None, False),
    }
    code, out, _ = await status(capsys, kubeconfig, "--region", "region-4")
    assert code == 1 and ["region-4", "-", "-", "-", "no", "verdict", "-"] in [line.split() for line in out.splitlines()]


async def test_wait_published_returns_once_every_region_caught_up(kube_api, kubeconfig, tmp_path, capsys):
    seed(kube_api, "chat")
    for region in MODES:
        await sidecar_pass(kubeconfig, tmp_path, region)
    bump(kube_api, "chat")
    waiting = asyncio.create_task(status(capsys, kubeconfig, "--wait-published", "--timeout", "30s", "chat"))
    try:
        for region in MODES:
            await asyncio.sleep(0.1)
            assert not waiting.done()
            await sidecar_pass(kubeconfig, tmp_path, region)
        code, out, _ = await asyncio.wait_for(waiting, 30)
    finally:
        if not waiting.done():
            waiting.cancel()
    assert code == 0 and "published in all 5 regions" in out


async def test_wait_published_gives_up_at_the_timeout_with_1(kube_api, kubeconfig, tmp_path, capsys):
    seed(kube_api, "chat")
    await sidecar_pass(kubeconfig, tmp_path, "region-0")
    bump(kube_api, "chat")
    code, out, err = await status(capsys, kubeconfig, "--wait-published", "--timeout", "1500ms")
    assert code == 1 and "not published everywhere within 1.5s" in err and "not in region-0" in out
    # A map named but not created yet is waited for, and at the timeout it is 1, not 2.
    code, out, err = await status(capsys, kubeconfig, "--wait-published", "--timeout", "1s", "later")
    assert code == 1 and "later: no such TrafficMap yet" in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        pytest.param(["nosuch"], "no TrafficMap nosuch in any namespace", id="unknown-name"),
        pytest.param(["-n", "dev"], "no TrafficMap on the cluster", id="no-maps"),
    ],
)
async def test_what_cannot_be_answered_exits_2(kube_api, kubeconfig, capsys, argv, needle):
    seed(kube_api, "chat")
    code, out, err = await status(capsys, kubeconfig, *argv)
    assert code == 2 and needle in err and out == ""


async def test_an_unusable_cluster_exits_2(kube_api, kubeconfig, tmp_path, capsys):
    code = await asyncio.to_thread(main, ["status", "--kubeconfig", str(tmp_path / "nope")])
    assert code == 2 and "no such file" in capsys.readouterr().err
    kube_api.refuse(403, verb="list", resource="trafficmaps")
    code, _, err = await status(capsys, kubeconfig)
    assert code == 2 and "API server: 403" in err and "trafficmaps" in err


async def test_forget_region_removes_what_a_gone_region_left_in_both_modes(kube_api, kubeconfig, tmp_path, capsys):
    seed(kube_api, "chat")
    seed(kube_api, "embed")
    for region in MODES:
        await sidecar_pass(kubeconfig, tmp_path, region)
    for gone in ("region-1", "region-4"):
        code, out, _ = await status(capsys, kubeconfig, "--forget-region", gone)
        assert code == 0
    assert "deleted 1 RegionReport(s), removed 0 condition(s)" in out
    code, out, _ = await status(capsys, kubeconfig, "-o", "json")
    assert code == 0
    assert set(regions_of(json.loads(out), "chat")) == {"region-0", "region-2", "region-3"}
    conditions = {c["type"] for c in kube_api.get(TM, "prod", "chat")["status"]["conditions"]}
    assert "gateway-publisher.ome.io/region-1" not in conditions and "gateway-publisher.ome.io/region-0" in conditions
    assert "Routable" in conditions  # OME's own condition stays
    assert sorted(o["region"] for o in kube_api.objects(RR)) == ["region-2", "region-3"]


# --- a fleet without the CRD, or without the right to read RegionReports (issue 27, item 13) -------


async def test_a_condition_only_fleet_without_the_crd_is_shown_and_forgotten(kube_api, kubeconfig, tmp_path, capsys):
    kube_api.uninstall("regionreports")  # a supported setup: every region in condition mode
    seed(kube_api, "chat")
    for region in ("region-0", "region-1"):
        await sidecar_pass(kubeconfig, tmp_path, region)
    code, out, err = await status(capsys, kubeconfig, "chat")
    assert (code, err) == (0, "") and "published in all 2 regions" in out
    code, out, err = await status(capsys, kubeconfig, "--forget-region", "region-1")
    assert (code, err) == (0, "") and "region region-1: deleted 0 RegionReport(s), removed 1 condition(s)" in out
    code, out, _ = await status(capsys, kubeconfig, "-o", "json")
    assert code == 0 and set(regions_of(json.loads(out), "chat")) == {"region-0"}


async def test_without_the_right_to_read_reports_the_conditions_are_shown_and_one_line_says_so(kube_api, kubeconfig, tmp_path, capsys):
    seed(kube_api, "chat")
    await sidecar_pass(kubeconfig, tmp_path, "region-0")
    kube_api.refuse(403, verb="list", resource="regionreports")
    code, out, err = await status(capsys, kubeconfig, "chat")
    assert code == 0 and "published in all 1 regions" in out
    assert len(err.splitlines()) == 1 and "RegionReports not read (403 Forbidden" in err and "report mode are not shown" in err
    code, out, _ = await status(capsys, kubeconfig, "-o", "json")
    assert "403 Forbidden" in json.loads(out)["unread"]


async def test_forgetting_a_region_that_left_nothing_is_not_a_success(kube_api, kubeconfig, tmp_path, capsys):
    seed(kube_api, "chat")
    await sidecar_pass(kubeconfig, tmp_path, "region-0")
    await sidecar_pass(kubeconfig, tmp_path, "region-2")
    code, out, err = await status(capsys, kubeconfig, "--forget-region", "region-9")
    assert code == 2 and out == ""
    assert err.splitlines() == ["ome-publisher status: region region-9 left nothing to remove in any namespace: no RegionReport, "
                                "no condition (regions seen: region-0, region-2)"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        pytest.param(["--forget-region", ""], "--forget-region: '' is not a region name", id="empty"),
        pytest.param(["--forget-region", "EU_West"], "--forget-region: 'EU_West' is not a region name", id="not-a-dns-label"),
        pytest.param(["--forget-region", "eu", "chat"], "it takes no NAME", id="with-a-map"),
        pytest.param(["--forget-region", "eu", "--wait-published", "--timeout", "1s"], "it takes no --wait-published, --timeout", id="with-wait"),
        pytest.param(["--forget-region", "eu", "--region", "us"], "it takes no --region", id="with-region"),
        pytest.param(["--forget-region", "eu", "-o", "json"], "it takes no --output", id="with-output"),
    ],
)
async def test_forget_region_refuses_what_it_cannot_mean_with_one_line(kube_api, kubeconfig, capsys, argv, needle):
    seed(kube_api, "chat")
    code, out, err = await status(capsys, kubeconfig, *argv)
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and needle in err
    assert kube_api.count("delete") == 0 and kube_api.count("patch") == 0
