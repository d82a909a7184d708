"""Issue 27, item 16: a malformed `--label-selector` was retried for ever (the API server's 400 was
taken for a transient fault: `--once` waited its whole timeout, the sidecar never became ready).
Now the selector is checked at start as the API server checks it (exit 2, one line naming the
flag), and a 400 on list or watch is a refusal: `--once` ends at once, the sidecar says it in
/readyz and retries at the refusal's slow pace."""

from __future__ import annotations

import aiohttp
import pytest

from publisher.cli import main
from publisher.source.selector import selector_problem
from tests.fakes.test_kube_api import MALFORMED_SELECTORS
from tests.test_fail_static import last_line, run_cli, seed, sidecar
from tests.gateways import eventually

# Selectors the API server (and the fake, which models it) accepts: every requirement form.
VALID_SELECTORS = ["", "  ", "tier=prod", "tier==prod", "tier!=prod", "tier=", "tier in (a,b)", "tier notin (a)",
                   "tier", "!tier", "! tier", "n>3", "n<3", "tier in ()", "tier in (a,)", "app.kubernetes.io/name=web",
                   "a=b,c!=d,e in (f),!g,h", " tier = prod , app in ( a , b ) ", "in=notin", "x in (in)"]  # fmt: skip


@pytest.mark.parametrize("selector", VALID_SELECTORS + MALFORMED_SELECTORS)
async def test_the_start_up_check_agrees_with_the_api_server(kube_api, selector: str) -> None:
    async with aiohttp.ClientSession() as http, http.get(
        f"{kube_api.url}/apis/ome.io/v1beta1/trafficmaps", params={"labelSelector": selector}
    ) as response:
        server_accepts = response.status == 200
        assert response.status in (200, 400)
    assert (selector_problem(selector) is None) == server_accepts, selector_problem(selector)
    assert server_accepts == (selector in VALID_SELECTORS)


@pytest.mark.parametrize("selector", ["app in a", "tier=prod!", "-bad=x", "app,"])
def test_a_malformed_selector_exits_2_naming_the_flag(capsys, tmp_path, selector: str) -> None:
    code = main(["run", "--label-selector", selector, "--once", "--json-path", str(tmp_path / "out.json")])
    captured = capsys.readouterr()
    assert code == 2, captured
    (line,) = captured.err.strip().splitlines()
    assert line.startswith(f"ome-publisher run: --label-selector: {selector!r} is not a label selector: "), line
    assert not (tmp_path / "out.json").exists()


def test_the_selector_from_the_environment_is_named_so(capsys, monkeypatch) -> None:
    monkeypatch.setenv("OME_PUBLISHER_LABEL_SELECTOR", "app in a")
    assert main(["run", "--once"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("ome-publisher run: --label-selector (from OME_PUBLISHER_LABEL_SELECTOR): 'app in a' is not"), line


async def test_a_400_on_list_ends_once_at_once(kube_api, kubeconfig, tmp_path) -> None:
    # A selector this version's check passes and the server still refuses (another server version).
    seed(kube_api)
    kube_api.fail_next(1000, 400, verb="list")
    code, stderr = await run_cli("--kubeconfig", str(kubeconfig), "--json-path", str(tmp_path / "out.json"),
                                 "--label-selector", "tier=prod", "--once", within=60, env={"OME_PUBLISHER_TIMEOUT": "20s"})  # fmt: skip
    assert code == 2, stderr
    line = last_line(stderr)
    # Not "no result within 20s": the refusal itself, with the option to check.
    assert line.startswith("ome-publisher run: list ") and "400 BadRequest" in line and "--label-selector" in line, line


async def test_a_400_while_running_is_a_refusal_in_readyz(kube_api, kubeconfig, tmp_path) -> None:
    seed(kube_api)
    kube_api.fail_next(1000, 400, verb="list")
    async with sidecar(kubeconfig, tmp_path / "out.json") as (publisher, task):
        await eventually(lambda: "400 BadRequest" in publisher.ready()[1] or task.done())
        ready, why = publisher.ready()
        assert not ready and "400 BadRequest" in why and "--label-selector" in why, why
