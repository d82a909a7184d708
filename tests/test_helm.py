"""The Helm chart, checked without a helm binary (none can be installed here).

values.yaml against values.schema.json, and bad values refused; every `.Values` path a template
reads exists in values.yaml, and every value is read; every flag the templates pass to
`ome-publisher run` and `ome-publisher envoy-bootstrap` is in that subcommand's --help; the
adapter choices match `adapters.ADAPTERS`; templates have no tabs and balanced `{{ }}`.
The templates are not rendered: that needs helm itself (`helm lint`, `helm template`).
"""

from __future__ import annotations

import copy
import functools
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from adapters import ADAPTERS

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "ome-gateway-publisher"
TEMPLATES = sorted((CHART / "templates").iterdir())
FLAG = re.compile(r"--[a-z][a-z0-9-]*")
COMMENT = re.compile(r"\{\{-?\s*/\*.*?\*/\s*-?\}\}", re.DOTALL)
VALUES_PATH = re.compile(r"\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


def _values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def _validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(json.loads((CHART / "values.schema.json").read_text()))


def _with(changes: dict[str, Any]) -> dict[str, Any]:
    """values.yaml with each dotted path set to its value."""
    values = copy.deepcopy(_values())
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = values
        for key in parents:
            node = node[key]
        node[leaf] = value
    return values


def _template_text(name: str) -> str:
    """A template without its {{/* comments */}}, which name flags they do not pass."""
    return COMMENT.sub("", (CHART / "templates" / name).read_text())


@functools.cache
def _help(subcommand: str) -> str:
    # Exactly what the console script does, without needing the package installed.
    script = "import sys; sys.argv[0] = 'ome-publisher'; from publisher.cli import main; sys.exit(main())"
    shown = subprocess.run(
        [sys.executable, "-c", script, subcommand, "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )
    assert shown.returncode == 0, shown.stderr
    return shown.stdout


def test_schema_is_a_valid_draft7_schema() -> None:
    jsonschema.Draft7Validator.check_schema(json.loads((CHART / "values.schema.json").read_text()))


def test_values_yaml_passes_the_schema() -> None:
    _validator().validate(_values())


@pytest.mark.parametrize(
    "changes",
    [
        {"controlPlane.inCluster": True, "controlPlane.kubeconfigSecret.name": ""},
        {"adapter.name": "httproute", "adapter.httproute.gateway": "gateways/global"},
        {"adapter.name": "nginx", "adapter.nginx.testCmd": "nginx -t"},
        {"replicas": 3, "leaderElection.enabled": True, "leaderElection.leaseNamespace": "ome-system"},
        {"watch.namespaces": ["llm", "team-a"], "gates.probeMaxAge": "5m", "watch.resync": "1m30s"},
    ],
    ids=["in-cluster-no-secret", "httproute-with-gateway", "nginx-test-cmd", "replicas-with-leases", "namespaces"],
)
def test_schema_accepts(changes: dict[str, Any]) -> None:
    _validator().validate(_with(changes))


@pytest.mark.parametrize(
    "changes",
    [
        {"adapter.name": "haproxy"},
        {"instanceName": "EU_West"},
        {"gateway.port": 80},
        {"metrics.port": 70000},
        {"log.format": "xml"},
        {"gates.omePublishedGate": "always"},
        {"watch.resync": "60"},
        {"watch.namespaces": ["llm", "llm"]},
        {"controlPlane.inCluster": False, "controlPlane.kubeconfigSecret.name": ""},
        {"adapter.name": "httproute", "adapter.httproute.gateway": ""},
        {"adapter.name": "httproute", "adapter.httproute.gateway": "no-namespace"},
        {"replicas": 2},
        {"gateway.envoy.image.tag": "latest"},
        {"podSecurityContext.runAsNonRoot": False},
        {"podSecurityContext.runAsUser": 0},
        {"replica": 1},
    ],
    ids=[
        "unknown-adapter", "instance-not-dns-label", "privileged-gateway-port", "metrics-port-range",
        "log-format", "published-gate", "resync-without-unit", "namespace-twice",
        "remote-control-plane-without-secret", "httproute-without-gateway", "httproute-gateway-not-ns-name",
        "replicas-without-leader-election", "envoy-latest", "root-allowed", "uid-0", "misspelt-key",
    ],
)
def test_schema_refuses(changes: dict[str, Any]) -> None:
    assert not _validator().is_valid(_with(changes))


def test_adapter_choices_are_the_adapters() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert sorted(schema["properties"]["adapter"]["properties"]["name"]["enum"]) == sorted(ADAPTERS)
    run_args = _template_text("_run-args.tpl")
    for name in ADAPTERS:
        assert f'eq .Values.adapter.name "{name}"' in run_args, f"_run-args.tpl has no branch for {name}"


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


@pytest.mark.parametrize(
    "template, subcommand",
    [("_run-args.tpl", "run"), ("_envoy-bootstrap-args.tpl", "envoy-bootstrap")],
)
def test_every_flag_the_chart_passes_is_in_help(template: str, subcommand: str) -> None:
    passed = set(FLAG.findall(_template_text(template)))
    assert passed
    documented = set(FLAG.findall(_help(subcommand)))
    assert not passed - documented, f"`ome-publisher {subcommand} --help` lacks {sorted(passed - documented)}"


def test_the_chart_calls_the_subcommands_its_flags_are_checked_against() -> None:
    assert re.search(r"^- run$", _template_text("_run-args.tpl"), re.MULTILINE)
    assert "exec ome-publisher envoy-bootstrap " in _template_text("deployment.yaml")
    assert 'include "ome-gateway-publisher.envoyBootstrapArgs"' in _template_text("deployment.yaml")
    assert 'include "ome-gateway-publisher.runArgs"' in _template_text("_sidecar.tpl")


@pytest.mark.parametrize("template", TEMPLATES, ids=[template.name for template in TEMPLATES])
def test_template_has_no_tabs_and_balanced_actions(template: Path) -> None:
    text = template.read_text()
    assert "\t" not in text
    assert text.count("{{") == text.count("}}")
