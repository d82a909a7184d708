"""The chart's alerts and dashboard, as the chart renders them, checked by Prometheus' own promtool.

Each rule gets series that must fire it and series that must not, with the labels a scrape through
the chart's ServiceMonitor gives them but a job name of some other scrape config, since the rules
select on the instance label and never on a job. The dead sidecar is tested both ways it dies: a
target that stops answering, and no target at all. The dashboard's queries parse as PromQL, and
both use only metrics the sidecar exports. Skipped only where promtool is absent (CI installs
Debian's `prometheus`).
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import helm_python as helm
import pytest
import yaml

from adapters.nginx.lua import LuaStats
from publisher import metrics
from publisher.split.check import SplitVerifier

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "ome-gateway-publisher"
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian package `prometheus`)")

INSTANCE = "eu-west"
# What a scrape of one sidecar adds, through a scrape config whose job name the rules do not know.
TARGET = {
    "ome_io_gateway_publisher_instance": INSTANCE,
    "job": "some-other-scrape-config",
    "instance": "10.0.0.7:9180",
    "pod": "eu-west-ome-gateway-publisher-6d4f9-x2x7q",
}
# The source's gauges the fail-static work (issue 13) adds; until it is merged, not in the registry.
METRIC = re.compile(r"\b(ome_gateway_publisher_[a-z_]+|up)\b")
OTHER_REGION = {**TARGET, "ome_io_gateway_publisher_instance": "us-east", "pod": "us-east-ome-gateway-publisher-5c8d7-q9r2t"}


def _series(metric: str, labels: dict[str, str], values: str, **extra: str) -> dict[str, str]:
    shown = ", ".join(f'{key}="{value}"' for key, value in {**labels, **extra}.items())
    return {"series": f"{metric}{{{shown}}}", "values": values}


@functools.cache
def _rules(per_map: str = "problems") -> dict[str, Any]:
    """The PrometheusRule's spec (a Prometheus rule file), as the chart renders it."""
    return _rendered_rules({"metrics": {"perMap": per_map, "prometheusRule": {"enabled": True}}})


def _rendered_rules(changes: dict[str, Any]) -> dict[str, Any]:
    chart = helm.Chart.load(str(CHART))
    rendered = chart.render({"region": INSTANCE, **changes}, name="region-1", namespace="ome-gateway")
    rule = yaml.safe_load(rendered["ome-gateway-publisher/templates/prometheusrule.yaml"])
    return rule["spec"]


def _rule(name: str, per_map: str = "problems") -> dict[str, Any]:
    (rule,) = [rule for group in _rules(per_map)["groups"] for rule in group["rules"] if rule["alert"] == name]
    return rule


@dataclass(frozen=True)
class Case:
    """One promtool test: input series, and the alerts expected at each evaluation time."""

    alert: str
    series: list[dict[str, str]]
    # eval time -> (labels, summary) of each alert expected firing; [] means must not fire.
    expected: dict[str, list[tuple[dict[str, str], str]]]
    per_map: str = "problems"
    fires: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fires", any(self.expected.values()))

    def promtool_test(self) -> dict[str, Any]:
        rule = _rule(self.alert, self.per_map)
        severity = rule["labels"]["severity"]
        return {
            "interval": "1m",
            "input_series": self.series,
            "alert_rule_test": [
                {
                    "eval_time": at,
                    "alertname": self.alert,
                    "exp_alerts": [
                        {
                            "exp_labels": {**labels, "severity": severity},
                            "exp_annotations": {"summary": summary, **{k: rule["annotations"][k] for k in ("description", "runbook_url")}},
                        }
                        for labels, summary in alerts
                    ],
                }
                for at, alerts in self.expected.items()
            ],
        }


MAP = {"namespace": "llm", "name": "chat"}

CASES: dict[str, Case] = {
    # A sidecar that crashed or hangs: its target stays, answering nothing.
    "dead-sidecar-target-down": Case(
        "OmeGatewayPublisherDown",
        [_series("up", TARGET, "1 1 0x15"), _series("up", OTHER_REGION, "1x17")],
        {"4m": [], "8m": [(TARGET, f"ome-gateway-publisher {TARGET['pod']} does not answer on /metrics")]},
    ),
    "up-sidecar": Case("OmeGatewayPublisherDown", [_series("up", TARGET, "1x20")], {"15m": []}),
    # A sidecar whose pod is gone (or never scheduled): no target, so no series at all.
    "dead-sidecar-no-target": Case(
        "OmeGatewayPublisherAbsent",
        [_series("up", TARGET, "1 1 stale"), _series("up", OTHER_REGION, "1x15")],
        {
            "3m": [],
            "10m": [({"ome_io_gateway_publisher_instance": INSTANCE},
                     f'No ome-gateway-publisher target matching ome_io_gateway_publisher_instance="{INSTANCE}" is scraped')],
        },
    ),
    "never-scraped": Case(
        "OmeGatewayPublisherAbsent",
        [_series("up", OTHER_REGION, "1x15")],
        {"10m": [({"ome_io_gateway_publisher_instance": INSTANCE},
                  f'No ome-gateway-publisher target matching ome_io_gateway_publisher_instance="{INSTANCE}" is scraped')]},
    ),
    "scraped-by-any-job": Case("OmeGatewayPublisherAbsent", [_series("up", TARGET, "1x15")], {"10m": []}),
    "source-stale": Case(
        "OmeGatewayPublisherSourceStale",
        # The TrafficMaps watch last succeeded at Unix time 120 (2m), then nothing for 12 minutes.
        [_series("ome_gateway_publisher_source_last_success_timestamp_seconds", TARGET, "0+60x2 120x14", resource="trafficmaps"),
         _series("ome_gateway_publisher_source_last_success_timestamp_seconds", TARGET, "0+60x16", resource="inferenceservices")],
        {"11m": [], "13m": [({**TARGET, "resource": "trafficmaps"}, f"{TARGET['pod']}: the trafficmaps watch has not succeeded for 11m 0s")]},
    ),
    "source-quiet-but-reconnecting": Case(
        "OmeGatewayPublisherSourceStale",
        # No event, but a reconnect every 5 minutes succeeds.
        [_series("ome_gateway_publisher_source_last_success_timestamp_seconds", TARGET,
                 "0x4 300x4 600x4 900x4 1200x4", resource="trafficmaps")],
        {"24m": []},
    ),
    "source-never-listed": Case(
        "OmeGatewayPublisherSourceStale",
        [_series("ome_gateway_publisher_source_last_success_timestamp_seconds", TARGET, "0x20", resource="trafficmaps")],
        {"15m": []},
    ),
    "source-refused": Case(
        "OmeGatewayPublisherSourceRefused",
        [_series("ome_gateway_publisher_source_refused", TARGET, "0 0 1x10", resource="trafficmaps", namespace="llm")],
        {"5m": [], "8m": [({**TARGET, "resource": "trafficmaps", "namespace": "llm"},
                           f"{TARGET['pod']}: the API server refuses the trafficmaps list or watch")]},
    ),
    "source-allowed": Case(
        "OmeGatewayPublisherSourceRefused",
        [_series("ome_gateway_publisher_source_refused", TARGET, "0x10", resource="trafficmaps", namespace="llm")],
        {"8m": []},
    ),
    "no-successful-apply": Case(
        "OmeGatewayPublisherNoSuccessfulApply",
        # Confirmed writes until 2m (Unix time 120), then none.
        [_series("ome_gateway_publisher_last_success_timestamp_seconds", TARGET, "0+60x2 120x20", adapter="envoy")],
        {"11m": [], "13m": [({**TARGET, "adapter": "envoy"}, f"No envoy write confirmed by {TARGET['pod']} for 11m 0s")]},
    ),
    "resyncs-confirm": Case(
        "OmeGatewayPublisherNoSuccessfulApply",
        [_series("ome_gateway_publisher_last_success_timestamp_seconds", TARGET, "0+60x20", adapter="envoy")],
        {"15m": []},
    ),
    "no-write-yet": Case(
        "OmeGatewayPublisherNoSuccessfulApply",
        [_series("ome_gateway_publisher_last_success_timestamp_seconds", TARGET, "0x20", adapter="envoy")],
        {"15m": []},
    ),
    "apply-failures": Case(
        "OmeGatewayPublisherApplyFailures",
        [_series("ome_gateway_publisher_publications_total", TARGET, "0x5 1 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2", adapter="nginx", result="failed")],
        {"4m": [], "8m": [({**TARGET, "adapter": "nginx", "result": "failed"}, f"{TARGET['pod']}: 2 nginx map writes failed or were rejected in 10 minutes")], "19m": []},
    ),
    "only-successes": Case(
        "OmeGatewayPublisherApplyFailures",
        [_series("ome_gateway_publisher_publications_total", TARGET, "0+5x20", adapter="nginx", result="published"),
         _series("ome_gateway_publisher_publications_total", TARGET, "0x20", adapter="nginx", result="failed")],
        {"15m": []},
    ),
    "map-held": Case(
        "OmeGatewayPublisherMapHeld",
        # The reason changes at 6m; the map stays held, so the timer keeps running.
        [_series("ome_gateway_publisher_map_held", TARGET, "1x5 stale", reason="ProbeStale", **MAP),
         _series("ome_gateway_publisher_map_held", TARGET, "_x6 1x10", reason="VerificationFailed", **MAP)],
        {"8m": [], "11m": [({**TARGET, **MAP}, "TrafficMap llm/chat held for over 10m")]},
    ),
    # Through the chart's ServiceMonitor with honorLabels false (its default) the pod's namespace
    # wins and the map's is exported_namespace (issue 23, finding 9): the summary still names the map.
    "map-held-scraped-without-honor-labels": Case(
        "OmeGatewayPublisherMapHeld",
        [_series("ome_gateway_publisher_map_held", {**TARGET, "namespace": "ome-gateway"}, "1x15", reason="ProbeStale",
                 exported_namespace="llm", name="chat")],
        {"11m": [({**TARGET, "namespace": "ome-gateway", "exported_namespace": "llm", "name": "chat"}, "TrafficMap llm/chat held for over 10m")]},
    ),
    "map-held-briefly": Case(
        "OmeGatewayPublisherMapHeld",
        [_series("ome_gateway_publisher_map_held", TARGET, "1x4 stale", reason="ProbeStale", **MAP)],
        {"12m": []},
    ),
    "maps-held-without-per-map-series": Case(
        "OmeGatewayPublisherMapHeld",
        [_series("ome_gateway_publisher_maps", TARGET, "3x15", state="held"),
         _series("ome_gateway_publisher_maps", TARGET, "9000x15", state="published")],
        {"8m": [], "11m": [({**TARGET, "state": "held"}, f"{TARGET['pod']}: 3 TrafficMaps held for over 10m")]},
        per_map="none",
    ),
    "no-map-held-without-per-map-series": Case(
        "OmeGatewayPublisherMapHeld",
        [_series("ome_gateway_publisher_maps", TARGET, "0x15", state="held")],
        {"12m": []},
        per_map="none",
    ),
    "slow-apply": Case(
        "OmeGatewayPublisherSlowApply",
        # Every event takes between 5 and 10 seconds to be confirmed.
        [_series("ome_gateway_publisher_event_to_apply_seconds_bucket", TARGET, "0x30", adapter="nginx", le="5"),
         _series("ome_gateway_publisher_event_to_apply_seconds_bucket", TARGET, "0+6x30", adapter="nginx", le="10"),
         _series("ome_gateway_publisher_event_to_apply_seconds_bucket", TARGET, "0+6x30", adapter="nginx", le="+Inf")],
        {"8m": [], "25m": [({**TARGET, "adapter": "nginx"},
                            f"{TARGET['pod']}: 99th percentile from TrafficMap change to confirmed nginx write is 9.95s (over 5s)")]},
    ),
    "fast-apply": Case(
        "OmeGatewayPublisherSlowApply",
        [_series("ome_gateway_publisher_event_to_apply_seconds_bucket", TARGET, "0+6x30", adapter="nginx", le="0.05"),
         _series("ome_gateway_publisher_event_to_apply_seconds_bucket", TARGET, "0+6x30", adapter="nginx", le="5"),
         _series("ome_gateway_publisher_event_to_apply_seconds_bucket", TARGET, "0+6x30", adapter="nginx", le="+Inf")],
        {"25m": []},
    ),
    "verification-failures": Case(
        "OmeGatewayPublisherVerificationFailures",
        [_series("ome_gateway_publisher_verification_failures_total", TARGET, "0x3 1x15")],
        {"2m": [], "6m": [(TARGET, f"{TARGET['pod']}: TrafficMap weights failed verification in the last 10 minutes")]},
    ),
    "no-verification-failures": Case(
        "OmeGatewayPublisherVerificationFailures",
        [_series("ome_gateway_publisher_verification_failures_total", TARGET, "4x15")],
        {"12m": []},
    ),
    "nginx-table-filling": Case(
        "OmeGatewayPublisherNginxTableFilling",
        # A 32 MiB table: 20 % free, then 5 % free from 3m.
        [_series("ome_gateway_publisher_nginx_table_free_bytes", TARGET, "6710886x2 1677721x15"),
         _series("ome_gateway_publisher_nginx_table_used_bytes", TARGET, "26843546x2 31876710x15")],
        {"6m": [], "9m": [(TARGET, f"{TARGET['pod']}: NGINX's Lua table has 5% of its room left")]},
    ),
    "nginx-table-roomy": Case(
        "OmeGatewayPublisherNginxTableFilling",
        [_series("ome_gateway_publisher_nginx_table_free_bytes", TARGET, "6710886x15"),
         _series("ome_gateway_publisher_nginx_table_used_bytes", TARGET, "26843546x15")],
        {"12m": []},
    ),
    "split-off": Case(
        "OmeGatewayPublisherSplitOff",
        # Off from 2m on; the alert waits 5m more.
        [_series("ome_gateway_publisher_split_off", TARGET, "_x2 1x15", namespace="prod", name="chat", gateway="gw-1")],
        {"5m": [], "8m": [({**TARGET, "namespace": "prod", "name": "chat", "gateway": "gw-1"},
                           f"{TARGET['pod']}: prod/chat is not served at its weights by gw-1")]},
    ),
    "split-off-cleared": Case(
        "OmeGatewayPublisherSplitOff",
        # Off for 4 minutes, then verified again (the series goes away): never long enough.
        [_series("ome_gateway_publisher_split_off", TARGET, "1x4 _x15", namespace="prod", name="chat", gateway="gw-1")],
        {"3m": [], "10m": []},
    ),
    "envoy-refuses-maps": Case(
        "OmeGatewayPublisherEnvoyRefusesMaps",
        # From 2m the rogue Envoy refuses two maps; the good one never does.
        [_series("ome_gateway_publisher_xds_maps_refused", TARGET, "0 0 2x15", envoy="rogue"),
         _series("ome_gateway_publisher_xds_maps_refused", TARGET, "0x17", envoy="good")],
        {"8m": [], "13m": [({**TARGET, "envoy": "rogue"}, f"{TARGET['pod']}: Envoy rogue has served older weights of 2 map(s) it refuses for over 10m")]},
    ),
    "envoy-refuses-briefly": Case(
        "OmeGatewayPublisherEnvoyRefusesMaps",
        # Refused for 5 minutes, then taken on a retry (or the Envoy left: the series goes away).
        [_series("ome_gateway_publisher_xds_maps_refused", TARGET, "1x5 0x10", envoy="rogue")],
        {"4m": [], "12m": []},
    ),
    # Another region's sidecar does not answer for this one.
    "other-region-down": Case(
        "OmeGatewayPublisherDown",
        [_series("up", TARGET, "1x15"), _series("up", OTHER_REGION, "0x15")],
        {"10m": []},
    ),
}


def _run_promtool(tmp_path: Path, case: Case) -> subprocess.CompletedProcess[str]:
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(_rules(case.per_map)))
    tests = tmp_path / "tests.yaml"
    tests.write_text(yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "1m", "tests": [case.promtool_test()]}))
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, "test", "rules", tests.name], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("per_map", ["problems", "all", "none"])
def test_promtool_checks_the_rendered_rules(tmp_path: Path, per_map: str) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(_rules(per_map)))
    assert PROMTOOL is not None
    checked = subprocess.run([PROMTOOL, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_rule(tmp_path: Path, case: Case) -> None:
    tested = _run_promtool(tmp_path, case)
    assert tested.returncode == 0, tested.stdout + tested.stderr


@pytest.mark.parametrize("per_map", ["problems", "none"])
def test_every_rule_is_tested_firing_and_silent(per_map: str) -> None:
    rendered = {rule["alert"] for group in _rules(per_map)["groups"] for rule in group["rules"]}
    cases = [case for case in CASES.values() if case.per_map == per_map or case.alert != "OmeGatewayPublisherMapHeld"]
    assert rendered == {case.alert for case in cases if case.fires}
    assert rendered == {case.alert for case in cases if not all(case.expected.values())}


def test_a_dead_sidecar_fires_an_alert_for_every_way_it_dies() -> None:
    for name in ("dead-sidecar-target-down", "dead-sidecar-no-target"):
        assert CASES[name].fires
        assert _rule(CASES[name].alert)["labels"]["severity"] == "critical"


def test_no_rule_names_a_job() -> None:
    for group in _rules()["groups"]:
        for rule in group["rules"]:
            assert "job" not in rule["expr"], rule["alert"]
            assert f'ome_io_gateway_publisher_instance="{INSTANCE}"' in rule["expr"], rule["alert"]


class _OneEnvoy:
    """An xDS transport with one Envoy connected, for the per-Envoy series."""

    def envoys(self) -> list[Any]:
        return [SimpleNamespace(name="ome-gateway-envoy", node="ome-gateway-envoy", peer="ipv4:127.0.0.1", nacks={}, unacked_since=None, sent=0, refused=0)]

    def served(self, key: Any) -> dict[str, str | None]:
        return {}


def _exported_names() -> set[str]:
    """Every series name the sidecar's registry can export, NGINX Lua mode's and xDS mode's included."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    metrics.watch_nginx_table(LuaStats(bytes_capacity=1 << 20, bytes_free=1 << 19))
    metrics.watch_envoys(_OneEnvoy())
    metrics.watch_split(SplitVerifier(_NoCounts(), 60.0, "envoy", lambda key: None))
    try:
        return {family.name + suffix for family in metrics.REGISTRY.collect() for suffix in suffixes[family.type]}
    finally:
        metrics.watch_nginx_table(None)
        metrics.watch_envoys(None)
        metrics.watch_split(None)


class _NoCounts:
    def enable(self, interval: float) -> None:
        return None

    async def collect(self) -> list[Any]:
        return []


def _dashboard_queries() -> list[str]:
    dashboard = json.loads((CHART / "files" / "dashboard.json").read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert len(queries) >= len(dashboard["panels"])
    return queries


def test_alerts_and_dashboard_use_only_metrics_the_sidecar_exports() -> None:
    known = _exported_names() | {"up"}
    exprs = [rule["expr"] for per_map in ("problems", "none") for group in _rules(per_map)["groups"] for rule in group["rules"]]
    used = {name for expr in exprs + _dashboard_queries() for name in METRIC.findall(expr)}
    assert used - known == set()


def test_the_dashboard_queries_are_promql(tmp_path: Path) -> None:
    # Grafana's variables, as Grafana substitutes them, turn each query into plain PromQL.
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{index}", "expr": query.replace("$__rate_interval", "2m").replace("$instance", ".*")}
        for index, query in enumerate(_dashboard_queries())
    ]}]}
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump(rules))
    assert PROMTOOL is not None
    checked = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_dashboard_covers_what_the_issue_asks() -> None:
    titles = " ".join(panel["title"] for panel in json.loads((CHART / "files" / "dashboard.json").read_text())["panels"]).lower()
    for subject in ("published", "held", "event to confirmed write", "reloads", "per gateway"):
        assert subject in titles, subject
    for query in _dashboard_queries():
        assert 'ome_io_gateway_publisher_instance=~"$instance"' in query, query


# --- runbooks, rules of one's own, Prometheus durations (issue 23, finding 5) ----------------------


def _github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces as '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_alert_links_its_runbook_in_the_chart_readme() -> None:
    readme = (CHART / "README.md").read_text()
    runbooks = readme[readme.index("\n## Runbooks\n") + 1:]
    runbooks = runbooks.split("\n## ")[0]
    anchors = {_github_anchor(line.lstrip("#")) for line in runbooks.splitlines() if line.startswith("### ")}
    base = yaml.safe_load((CHART / "values.yaml").read_text())["metrics"]["prometheusRule"]["runbookBaseUrl"]
    for per_map in ("problems", "none"):
        for rule in (rule for group in _rules(per_map)["groups"] for rule in group["rules"]):
            url = rule["annotations"]["runbook_url"]
            assert url == f"{base}#{rule['alert'].lower()}", url
            assert url.partition("#")[2] in anchors, f"{rule['alert']}: no runbook section in the chart README"
    # And no runbook for an alert that does not exist.
    alerts = {rule["alert"].lower() for per_map in ("problems", "none") for group in _rules(per_map)["groups"] for rule in group["rules"]}
    assert anchors == alerts


def test_the_runbook_base_url_is_a_value() -> None:
    spec = _rendered_rules({"metrics": {"prometheusRule": {"enabled": True, "runbookBaseUrl": "https://wiki.example.com/ome"}}})
    for rule in spec["groups"][0]["rules"]:
        assert rule["annotations"]["runbook_url"] == f"https://wiki.example.com/ome#{rule['alert'].lower()}"


MY_RULES = [
    {"alert": "MyGatewayHeldTooMany", "expr": f'ome_gateway_publisher_maps{{ome_io_gateway_publisher_instance="{INSTANCE}",state="held"}} > 100',
     "for": "15m", "labels": {"severity": "page"}, "annotations": {"summary": "over 100 maps held"}},
    {"record": "ome:published_maps:sum", "expr": 'sum(ome_gateway_publisher_maps{state="published"})'},
]


def test_additional_rules_join_the_charts_group(tmp_path: Path) -> None:
    spec = _rendered_rules({"metrics": {"prometheusRule": {"enabled": True, "additionalRules": MY_RULES}}})
    (group,) = spec["groups"]
    assert group["rules"][-2:] == MY_RULES
    assert {rule["alert"] for rule in _rules()["groups"][0]["rules"]} <= {rule.get("alert") for rule in group["rules"]}
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(spec))
    assert PROMTOOL is not None
    checked = subprocess.run([PROMTOOL, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize("rule", [{"alert": "NoExpr"}, {"expr": "up"}, {"alert": "A", "record": "b", "expr": "up"}, {"alert": "A", "expr": "up", "for": "5 minutes"}],
                         ids=["no-expr", "neither-alert-nor-record", "both", "bad-for"])
def test_the_schema_refuses_a_rule_prometheus_would_not_load(rule: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        helm.Chart.load(str(CHART)).validate_schema({"metrics": {"prometheusRule": {"additionalRules": [rule]}}})


@pytest.mark.parametrize("duration", ["5m", "1h30m", "2d12h", "1w", "90s", "1y2w3d4h5m6s7ms", "0", "1s1h", "30s30s", "1.5m", "5"])
def test_the_schemas_prometheus_durations_are_the_ones_prometheus_loads(tmp_path: Path, duration: str) -> None:
    admitted = True
    try:
        helm.Chart.load(str(CHART)).validate_schema({"metrics": {"prometheusRule": {"downFor": duration}}})
    except helm.HelmValuesError:
        admitted = False
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "up == 0", "for": duration}]}]}))
    assert PROMTOOL is not None
    loaded = subprocess.run([PROMTOOL, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60, check=False).returncode == 0
    assert admitted == loaded, f"{duration}: schema {'admits' if admitted else 'refuses'}, promtool {'loads' if loaded else 'refuses'}"
