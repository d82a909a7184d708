"""Issue 13: fail static and fail clearly, against the fake API server with its faults injected.

One test (or one parametrized test) per finding of the issue, each named after what it proves:
--once under API faults, watch backoff, leader election under restarts and hangs, --once with
--leader-elect, stable stale-probe conditions, quiet logs, deep manifests, start-up errors, and
the default port. Then the outage the issue's "done when" describes, and refusals while running.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import sys
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from adapters import ADAPTERS
from adapters.json import JsonOptions
from publisher import loop, metrics, status
from publisher.cli import main
from publisher.kube import TRAFFIC_MAPS, Kube
from publisher.loop import LeaderOptions, LoopOptions, Publisher
from publisher.core.model import parse_traffic_map
from publisher.core.values import MapKey
from publisher.source.directory import DirectorySource
from publisher.source.informer import Informer, WatchOptions
from publisher.source.kube_source import KubeSource
from publisher.source.store import Store, Stores
from tests.builders import make_entry, make_isvc, make_map
from tests.fakes.kube_api import FakeKubeAPI
from tests.gateways import eventually, free_port, taken_port
from tests.test_kube_integration import TM, ISVC, ours, published, rescale, seed

ROOT = Path(__file__).resolve().parent.parent
LEASES = "coordination.k8s.io/v1/leases"
LEASE_NAME = "ome-gateway-publisher-eu"
FIELD_MANAGER = "ome-gateway-publisher-eu"
# Fast but in client-go's proportions: every attempt ends before the renew deadline, which ends
# well before the lease does.
FAST_LEASE = {"lease_duration": 6, "renew_deadline": 2, "retry_period": 1}
FAST_WATCH = WatchOptions(backoff_initial=0.05, backoff_max=0.5, silence_timeout=5, refusal_retry=0.2, region="eu")


@contextlib.asynccontextmanager
async def sidecar(
    kubeconfig: Path,
    out: Path,
    *,
    leader: LeaderOptions | None = None,
    resync: float = 3600,
    probe_max_age: float | None = None,
    wall_clock: Callable[[], datetime] | None = None,
    watch: WatchOptions = FAST_WATCH,
) -> AsyncIterator[tuple[Publisher, asyncio.Task[None]]]:
    """The long-running loop (kube source, JSON gateway, status), and its task to check it lives."""
    kube = await Kube.connect(kubeconfig)
    stores = Stores.empty()
    options = LoopOptions(region="eu", resync=resync, probe_max_age=probe_max_age)
    extra: dict[str, Any] = {"wall_clock": wall_clock} if wall_clock is not None else {}
    sink = status.ConditionSink(kube, stores.maps, "eu", **extra)
    publisher = Publisher(stores, ADAPTERS["json"].engine("json", JsonOptions(json_path=out)), options, status_sink=sink, **extra)
    source = KubeSource(kube, stores, publisher, watch, clock=publisher.clock)
    task = asyncio.create_task(loop.run(publisher, source, leader=leader, kube=kube))
    try:
        yield publisher, task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await kube.close()


async def run_cli(*args: str, within: float = 60, env: dict[str, str] | None = None) -> tuple[int, str]:
    """`ome-publisher run ARGS` as a process; its exit code and stderr. Killed (and the test
    failed) when it does not end `within` seconds."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "publisher.cli", "run", *args, cwd=ROOT, env={**os.environ, **(env or {})},
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        _, err = await asyncio.wait_for(process.communicate(), within)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise AssertionError(f"ome-publisher run {' '.join(args)} did not end within {within}s") from None
    assert process.returncode is not None
    return process.returncode, err.decode()


def last_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    return stderr.strip().splitlines()[-1]


# --- 1. --once and --dry-run end, with exit 2 and a message that says what to fix -----------------


@pytest.mark.parametrize(
    ("fault", "mode", "expected"),
    [
        ("unreachable", "--once", ["no result within 3s", "waiting for the source's first full view", "Cannot connect to host 127.0.0.1"]),
        ("401", "--once", ["401 Unauthorized", "credentials", "ServiceAccount token"]),
        ("403", "--once", ["list trafficmaps.ome.io in all namespaces: 403 Forbidden", "cannot list resource", "ClusterRole",
                           'apiGroups: ["ome.io"], resources: ["trafficmaps"], verbs: ["get", "list", "watch"]']),
        ("403", "--dry-run", ["403 Forbidden", 'resources: ["trafficmaps"]']),
    ],
    ids=["unreachable", "401", "403", "403-dry-run"],
)
async def test_one_pass_against_a_failing_api_exits_2_in_bounded_time(kube_api, kubeconfig, tmp_path, fault, mode, expected):
    seed(kube_api)
    if fault == "unreachable":
        await kube_api.go_down()
    elif fault == "401":
        kube_api.refuse(401)
    else:
        kube_api.refuse(403, verb="list", resource="trafficmaps")
    # The timeout through the environment: the same run on code without --timeout hangs instead.
    code, stderr = await run_cli("--kubeconfig", str(kubeconfig), "--json-path", str(tmp_path / "out.json"), mode,
                                 within=30, env={"OME_PUBLISHER_TIMEOUT": "3s"})
    assert code == 2, stderr
    line = last_line(stderr)
    assert line.startswith("ome-publisher run: "), line
    for needle in expected:
        assert needle in line, (needle, line)
    assert not (tmp_path / "out.json").exists()


# --- 2. the watch backoff starts over once a watch has been healthy -------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class NullSink:
    def changed(self, keys, *, at):  # type: ignore[no-untyped-def]
        pass

    def reported(self, keys):  # type: ignore[no-untyped-def]
        pass

    def synced(self) -> None:
        pass


async def test_watch_backoff_resets_after_a_healthy_watch_and_grows_without_one(kube_api, kubeconfig):
    seed(kube_api)
    clock = FakeClock()
    delays: list[float] = []

    async def sleep(seconds: float) -> None:
        delays.append(seconds)
        await asyncio.sleep(0)

    kube = await Kube.connect(kubeconfig)
    informer = Informer(
        kube, TRAFFIC_MAPS, namespace=None, store=Store(), parse=parse_traffic_map, sink=NullSink(), on_synced=lambda: None,
        options=WatchOptions(backoff_initial=1.0, backoff_max=64.0, backoff_reset=60.0), clock=clock, sleep=sleep,
    )  # fmt: skip
    task = asyncio.create_task(informer.run())

    def watches() -> int:
        return kube_api.count("watch", path="/apis/ome.io/v1beta1/trafficmaps")

    try:
        await eventually(lambda: watches() == 1)
        for drop in range(8):  # eight drops, each after a healthy minute
            clock.now += 61
            kube_api.drop_watches()
            await eventually(lambda: watches() == drop + 2)
        assert len(delays) == 8 and max(delays) <= 1.0, delays  # every one the first step again
        for drop in range(4):  # four drops in quick succession: the backoff grows
            kube_api.drop_watches()
            await eventually(lambda: watches() == 10 + drop)
        # 2, 4, 8, 16 s (the last healthy drop already took the first step), jitter down to half.
        assert all(2**i <= delay <= 2 ** (i + 1) for i, delay in enumerate(delays[8:])), delays
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await kube.close()


# --- 3. leader election survives restarts and hangs, and releases the Lease -----------------------


def holder(api: FakeKubeAPI) -> str | None:
    lease = api.get(LEASES, "prod", LEASE_NAME)
    return None if lease is None else lease["spec"].get("holderIdentity")


async def test_leader_election_survives_an_api_restart(kube_api, kubeconfig, tmp_path):
    seed(kube_api)
    out = tmp_path / "out.json"
    async with sidecar(kubeconfig, out, leader=LeaderOptions("prod", "replica-a", **FAST_LEASE)) as (publisher, task):
        await eventually(lambda: (published(out) and holder(kube_api) == "replica-a") or task.done())
        await kube_api.go_down()
        await eventually(lambda: not publisher.outbox.leading or task.done())  # no renew: status writes stop
        assert not task.done(), task
        assert published(out) == {"chat": [2, 3]}  # the gateway keeps serving
        await kube_api.come_back()
        await eventually(lambda: publisher.outbox.leading or task.done(), timeout=20)
        assert not task.done(), task
        rescale(kube_api, "chat", 4)
        await eventually(lambda: ours(kube_api).get("observedGeneration") == 2)


async def test_a_leader_whose_renew_hangs_stops_writing_before_its_lease_expires(kube_api, kubeconfig, tmp_path):
    seed(kube_api)
    async with sidecar(kubeconfig, tmp_path / "out.json", leader=LeaderOptions("prod", "replica-a", **FAST_LEASE)) as (publisher, task):
        await eventually(lambda: holder(kube_api) == "replica-a" or task.done())
        kube_api.set_latency(120)  # every call from now on hangs, the renews included
        await eventually(lambda: not publisher.outbox.leading or task.done(), interval=0.01)
        stopped = datetime.now(UTC)
        assert not task.done(), task
        lease = kube_api.get(LEASES, "prod", LEASE_NAME)
        assert lease is not None
        renewed = datetime.fromisoformat(lease["spec"]["renewTime"].replace("Z", "+00:00"))
        assert stopped < renewed + timedelta(seconds=lease["spec"]["leaseDurationSeconds"])
        kube_api.set_latency(0)  # end the hang: the waiting calls are answered, nothing is left behind


async def test_the_lease_is_released_on_shutdown(kube_api, kubeconfig, tmp_path):
    seed(kube_api)
    async with sidecar(kubeconfig, tmp_path / "out.json", leader=LeaderOptions("prod", "replica-a", **FAST_LEASE)) as (publisher, task):
        await eventually(lambda: holder(kube_api) == "replica-a" or task.done())
        assert publisher.outbox.leading
    assert holder(kube_api) == ""


# --- 4. --once --leader-elect is refused before anything is written -------------------------------


async def test_once_with_leader_election_is_refused_and_writes_no_status(kube_api, kubeconfig, tmp_path):
    seed(kube_api)
    code, stderr = await run_cli("--kubeconfig", str(kubeconfig), "--json-path", str(tmp_path / "out.json"), "--region", "eu",
                                 "--once", "--leader-elect", "--lease-namespace", "prod", within=30)
    assert code == 2, stderr
    assert "--once cannot be combined with --leader-elect" in last_line(stderr)
    assert kube_api.count("patch", field_manager=FIELD_MANAGER) == 0
    assert kube_api.get(LEASES, "prod", LEASE_NAME) is None


# --- 5. a stalled prober changes the condition once, not on every pass ----------------------------


async def test_a_stalled_prober_is_written_once_not_on_every_pass(kube_api, kubeconfig, tmp_path, caplog):
    probe = {"result": "Passing", "gated": False, "lastProbeTime": "2026-01-01T00:00:00Z"}
    seed(kube_api, entries=[
        make_entry("worker-a", allocated=4, ready=4, weight=2, probe=probe),
        make_entry("worker-b", allocated=2, ready=2, factor="3", weight=3),
    ])  # fmt: skip
    reads = itertools.count()

    def wall_clock() -> datetime:  # seven seconds pass between any two looks at the clock
        return datetime(2026, 1, 1, 1, tzinfo=UTC) + timedelta(seconds=7 * next(reads))

    with caplog.at_level(logging.WARNING, logger="publisher.loop"):
        async with sidecar(kubeconfig, tmp_path / "out.json", resync=0.1, probe_max_age=60, wall_clock=wall_clock) as (publisher, _):
            await eventually(lambda: ours(kube_api).get("reason") == "Published")
            version = kube_api.get(TM, "prod", "chat")["metadata"]["resourceVersion"]
            start = next(reads)
            await eventually(lambda: next(reads) > start + 20)  # ten passes or more
            await eventually(lambda: len(publisher.outbox.due) == 0)
            debug = {m["name"]: m for m in publisher.debug_maps()}
    # The condition never changed again (a write racing the watch event of the first one may
    # repeat it word for word, which the server takes as a no-op).
    assert kube_api.get(TM, "prod", "chat")["metadata"]["resourceVersion"] == version
    assert "probe results older than 60s for worker-a" in ours(kube_api)["message"]
    assert [r.getMessage() for r in caplog.records].count("prober stalled") == 1
    assert debug["chat"]["probeAgeSeconds"]["worker-a"] > 3600  # the age lives in /debug/maps


# --- 6. an InferenceService without a TrafficMap is not a withdrawal ------------------------------


async def test_events_of_an_inference_service_without_a_map_log_nothing(kube_api, kubeconfig, tmp_path, caplog):
    seed(kube_api)
    kube_api.create(make_isvc("lonely"))
    out = tmp_path / "out.json"
    with caplog.at_level(logging.INFO, logger="publisher.loop"):
        async with sidecar(kubeconfig, out, watch=FAST_WATCH) as (publisher, _):
            await eventually(lambda: published(out) == {"chat": [2, 3]})
            for n in range(3):
                lonely = kube_api.get(ISVC, "prod", "lonely")
                lonely["metadata"].setdefault("labels", {})["touched"] = str(n)
                kube_api.update(lonely)
            # A later event on the same watch: once it is handled, lonely's are too.
            chat = kube_api.get(ISVC, "prod", "chat")
            chat["metadata"]["annotations"]["ome.io/global-host"] = "chat2.example.com"
            kube_api.update(chat)
            await eventually(lambda: publisher.published[MapKey("prod", "chat")].hostname == "chat2.example.com")
            kube_api.delete(TM, "prod", "chat")
            await eventually(lambda: any(r.getMessage() == "map withdrawn" for r in caplog.records))
    withdrawn = [r.map for r in caplog.records if r.getMessage() == "map withdrawn"]  # type: ignore[attr-defined]
    assert withdrawn == ["prod/chat"]


# --- 7. deep manifests are refused, by verify (exit 2) and by the directory source ---------------

DEEP_JSON = "[" * 20_000 + "]" * 20_000
DEEP_YAML = "kind: TrafficMap\nspec: " + "[" * 20_000 + "]" * 20_000 + "\n"


@pytest.mark.parametrize("text", [DEEP_JSON, DEEP_YAML], ids=["json", "yaml"])
def test_verify_refuses_a_deeply_nested_file_with_exit_2(tmp_path, capsys, text):
    path = tmp_path / "deep.yaml"
    path.write_text(text)
    assert main(["verify", str(path)]) == 2
    # The project's behaviour, not a parser's words: libyaml (PyYAML 6.0.4) has a nesting limit of
    # its own and may answer first, in a line of its own that still names the file.
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ome-publisher verify: {path}"), lines


@pytest.mark.parametrize("levels", [101, 500])
def test_the_projects_nesting_limit_answers_below_any_parsers(tmp_path, capsys, levels):
    path = tmp_path / "deep.yaml"
    path.write_text("kind: TrafficMap\nspec: " + "[" * levels + "]" * levels + "\n")
    assert main(["verify", str(path)]) == 2
    assert capsys.readouterr().err.strip() == f"ome-publisher verify: {path}: nested deeper than 100 levels"


async def test_the_directory_source_skips_a_deeply_nested_file_and_keeps_the_others(tmp_path):
    import yaml

    (tmp_path / "deep.json").write_text(DEEP_JSON)
    (tmp_path / "chat.yaml").write_text(yaml.safe_dump_all([make_isvc(), make_map()]))
    stores = Stores.empty()
    errors = metrics.SOURCE_ERRORS.labels(source="dir")
    before = errors._value.get()
    source = DirectorySource(tmp_path, stores, NullSink(), clock=lambda: 0.0)
    await source.scan()
    assert list(stores.maps.keys()) == [MapKey("prod", "chat")]
    assert errors._value.get() == before + 1
    assert source.problem() == f"{tmp_path / 'deep.json'}: nested deeper than 100 levels"


# --- 8. start-up errors: one line naming the option or file, exit 2 --------------------------------


def _bad_kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], str]:
    path = tmp_path / "kubeconfig"
    path.write_text("[\n")
    return ["--kubeconfig", str(path)], f"--kubeconfig {path}: not a usable kubeconfig: "


def _missing_kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], str]:
    return ["--kubeconfig", str(tmp_path / "nope")], f"--kubeconfig {tmp_path / 'nope'}: no such file"


def _no_kubeconfig_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], str]:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return [], f"the default kubeconfig {tmp_path / '.kube' / 'config'}: no such file (not in a cluster, $KUBECONFIG unset: pass --kubeconfig)"


def _envoy_admin_without_scheme(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], str]:
    return ["--adapter", "envoy", "--envoy-dir", str(tmp_path), "--envoy-admin", "localhost:9901"], "--envoy-admin: 'localhost:9901' is not a URL"


def _unreachable_nginx_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], str]:
    conf = tmp_path / "missing" / "publisher.conf"
    args = ["--adapter", "nginx", "--nginx-conf-file", str(conf), "--nginx-pid-file", str(tmp_path / "pid")]
    return args, f"--nginx-conf-file {conf}: directory {conf.parent} does not exist"


@pytest.mark.parametrize(
    "case",
    [_bad_kubeconfig, _missing_kubeconfig, _no_kubeconfig_at_all, _envoy_admin_without_scheme, _unreachable_nginx_file],
    ids=["kubeconfig-not-yaml", "kubeconfig-missing", "no-kubeconfig", "envoy-admin-no-scheme", "nginx-file-unreachable"],
)
def test_start_up_errors_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch, case):
    args, expected = case(tmp_path, monkeypatch)
    code = main(["run", "--json-path", str(tmp_path / "out.json"), "--once", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"ome-publisher run: {expected}"), err


def test_a_listen_port_in_use_is_one_line_and_exit_2(tmp_path, capsys):
    with taken_port() as port:
        maps = tmp_path / "maps"
        maps.mkdir()
        code = main(["run", "--source", f"dir:{maps}", "--json-path", str(tmp_path / "out.json"), "--listen", f"127.0.0.1:{port}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.strip() == f"ome-publisher run: --listen: cannot listen on 127.0.0.1:{port}: Address already in use"


def test_an_xds_listen_address_in_use_is_one_line_and_exit_2(tmp_path, capsys):
    """Issue 21 finding 7: as for --listen (gRPC no longer sets SO_REUSEPORT, so another sidecar
    on the address is refused too: tests/adapters/test_envoy_xds_fleet.py)."""
    with taken_port() as port:
        maps = tmp_path / "maps"
        maps.mkdir()
        code = main(["run", "--source", f"dir:{maps}", "--adapter", "envoy", "--envoy-xds-listen", f"127.0.0.1:{port}",
                     "--listen", f"127.0.0.1:{free_port()}"])
    err = capsys.readouterr().err
    assert code == 2, err
    # After the HTTP server's "serving" line: the xDS server binds in the sidecar's task group.
    assert "Traceback" not in err and [line for line in err.splitlines() if line.startswith("ome-publisher run:")] == [
        f"ome-publisher run: --envoy-xds-listen: cannot listen on 127.0.0.1:{port}: Address already in use"], err


# --- 9. the default port is no gateway's (the NGINX recipe is run in test_readme_recipes.py) ---------


def test_the_default_listen_port_is_not_a_gateway_port():
    from publisher.cli.config import RunConfig

    default = RunConfig().listen_address
    assert default == ("0.0.0.0", 9180)
    readme = (ROOT / "README.md").read_text()
    assert "--listen 0.0.0.0:8080" in readme  # Envoy's listener in the Envoy recipe
    from adapters.nginx import NginxOptions

    assert default[1] != int(NginxOptions.model_fields["nginx_listen"].default)


# --- Build: fail static through a long outage; refusals while running -----------------------------


async def test_an_outage_of_ten_resyncs_keeps_serving_and_ready_then_converges(kube_api, kubeconfig, tmp_path):
    seed(kube_api)
    out = tmp_path / "out.json"
    async with sidecar(kubeconfig, out, resync=0.2) as (publisher, task):
        await eventually(lambda: published(out) == {"chat": [2, 3]})
        await eventually(lambda: publisher.ready()[0])
        await kube_api.go_down()
        loop_time = asyncio.get_running_loop().time
        end = loop_time() + 10 * 0.2
        while loop_time() < end:  # bounded: ten resync intervals, sampled
            assert publisher.ready()[0], publisher.ready()
            assert published(out) == {"chat": [2, 3]}
            await asyncio.sleep(0.05)
        ready, why = publisher.ready()
        assert ready and "the gateway keeps serving while the source fails" in why, why
        await kube_api.come_back()
        rescale(kube_api, "chat", 4)
        await eventually(lambda: published(out) == {"chat": [1, 3]})
        assert not task.done()
        await eventually(lambda: publisher.ready() == (True, "ready"))


async def test_a_refusal_while_running_is_reported_once_then_clears(kube_api, kubeconfig, tmp_path, caplog):
    seed(kube_api)
    kube_api.refuse(403, verb="list", resource="trafficmaps")
    refused = metrics.SOURCE_REFUSED.labels(resource="trafficmaps", namespace="")
    with caplog.at_level(logging.ERROR, logger="publisher.source"):
        async with sidecar(kubeconfig, tmp_path / "out.json") as (publisher, task):
            await eventually(lambda: kube_api.count("list", path="/apis/ome.io/v1beta1/trafficmaps") >= 3)
            ready, why = publisher.ready()
            assert not ready and "403 Forbidden" in why and 'resources: ["trafficmaps"]' in why, why
            assert refused._value.get() == 1
            kube_api.allow()
            await eventually(lambda: publisher.ready()[0] or task.done())
            assert refused._value.get() == 0
    messages = [r for r in caplog.records if r.getMessage() == "source refused"]
    assert len(messages) == 1 and messages[0].verb == "list"  # type: ignore[attr-defined]


async def test_a_stale_source_is_logged_once_and_its_recovery_too(kube_api, kubeconfig, tmp_path, caplog):
    seed(kube_api)
    out = tmp_path / "out.json"
    last_success = metrics.SOURCE_LAST_SUCCESS.labels(resource="trafficmaps", namespace="")

    def logged() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "publisher.source"]

    with caplog.at_level(logging.INFO, logger="publisher.source"):
        async with sidecar(kubeconfig, out, watch=dataclasses.replace(FAST_WATCH, stale_after=0.4)) as (publisher, task):
            await eventually(lambda: published(out) == {"chat": [2, 3]})
            before_outage = last_success._value.get()
            await kube_api.go_down()
            await eventually(lambda: "source stale, gateway keeps serving" in logged())
            assert published(out) == {"chat": [2, 3]} and publisher.ready()[0]
            await kube_api.come_back()
            await eventually(lambda: "source fresh again" in logged())
            assert not task.done()
    assert logged().count("source stale, gateway keeps serving") == 1
    # One per informer (trafficmaps, inferenceservices): the first failure of the streak, not each retry.
    assert logged().count("watch restarting") == 2 and logged().count("source recovered") == 2
    assert last_success._value.get() > before_outage


async def test_verify_on_a_cluster_that_refuses_exits_2_naming_the_rule(kube_api, kubeconfig):
    seed(kube_api)
    kube_api.refuse(403, verb="list", resource="inferenceservices")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "publisher.cli", "verify", "--kubeconfig", str(kubeconfig), cwd=ROOT,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 2
    line = last_line(err.decode())
    assert "403 Forbidden" in line and 'resources: ["inferenceservices"]' in line, line
