"""Chart options next to external-dns, ingress-nginx and cert-manager (issue 23, finding 9): images
by digest, and a ServiceMonitor with a namespace, a scrape timeout, relabelings and honorLabels as a
value (false by default: the pod's `namespace` label stays, the map's is `exported_namespace`).
Rendered by the real Helm engine; tests/test_helm.py lints and validates the option sets."""

from __future__ import annotations

import functools
from typing import Any

import helm_python as helm
import pytest
import yaml

from tests.test_helm import CHART, NAMESPACE, RELEASE

DIGEST = "sha256:" + "0123456789abcdef" * 4


@functools.cache
def _chart() -> Any:
    return helm.Chart.load(str(CHART))


def _objects(changes: dict[str, Any]) -> list[dict[str, Any]]:
    rendered = _chart().render(changes, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [doc for path, text in sorted(rendered.items()) if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]


def _images(changes: dict[str, Any]) -> dict[str, str]:
    """Container name -> image, over the Deployment's pod and the helm test Pod."""
    images = {}
    for item in _objects(changes):
        spec = item["spec"]["template"]["spec"] if item["kind"] == "Deployment" else item["spec"] if item["kind"] == "Pod" else None
        if spec is not None:
            for container in spec["containers"] + spec.get("initContainers", []):
                images[container["name"]] = container["image"]
    return images


@pytest.mark.parametrize("gateway", ["envoy", "nginx"])
def test_images_by_digest(gateway: str) -> None:
    by_tag = _images({"adapter": {"name": gateway}})
    sidecar_containers = {"publisher", "check", "envoy-bootstrap" if gateway == "envoy" else "nginx-config"}
    assert {by_tag[name] for name in sidecar_containers} == {"ghcr.io/ome/ome-gateway-publisher:0.1.0"}
    pinned = _images({"adapter": {"name": gateway}, "image": {"tag": "0.1.0", "digest": DIGEST}, "gateway": {gateway: {"image": {"digest": DIGEST}}}})
    assert {pinned[name] for name in sidecar_containers} == {f"ghcr.io/ome/ome-gateway-publisher@{DIGEST}"}
    repository = {"envoy": "envoyproxy/envoy", "nginx": "ghcr.io/ome/ome-gateway-nginx-lua"}[gateway]
    assert pinned[gateway] == f"{repository}@{DIGEST}"


@pytest.mark.parametrize("digest", ["0123", "sha256:XYZ", "md5:" + "0" * 32, "sha256:" + "0" * 63])
def test_the_schema_refuses_what_is_no_digest(digest: str) -> None:
    with pytest.raises(helm.HelmValuesError):
        _chart().validate_schema({"image": {"digest": digest}})


def _monitor(changes: dict[str, Any]) -> dict[str, Any]:
    values = {"metrics": {"serviceMonitor": {"enabled": True, **changes}}}
    (monitor,) = [item for item in _objects(values) if item["kind"] == "ServiceMonitor"]
    return monitor


def test_the_service_monitor_keeps_the_pods_labels_by_default() -> None:
    monitor = _monitor({})
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["honorLabels"] is False
    assert "scrapeTimeout" not in endpoint and "relabelings" not in endpoint and "metricRelabelings" not in endpoint
    assert monitor["metadata"]["namespace"] == NAMESPACE and "namespaceSelector" not in monitor["spec"]
    assert _monitor({"honorLabels": True})["spec"]["endpoints"][0]["honorLabels"] is True


def test_the_service_monitor_takes_a_namespace_timeout_and_relabelings() -> None:
    relabelings = [{"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node", "action": "replace"}]
    metric_relabelings = [{"sourceLabels": ["__name__"], "regex": "python_.*", "action": "drop"}]
    monitor = _monitor({"namespace": "monitoring", "scrapeTimeout": "5s", "interval": "15s",
                        "relabelings": relabelings, "metricRelabelings": metric_relabelings})  # fmt: skip
    assert monitor["metadata"]["namespace"] == "monitoring"
    # From its own namespace it still selects the metrics Service in the release's.
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["interval"], endpoint["scrapeTimeout"]) == ("15s", "5s")
    assert endpoint["relabelings"] == relabelings and endpoint["metricRelabelings"] == metric_relabelings


@pytest.mark.parametrize(
    "changes",
    [{"scrapeTimeout": "5 seconds"}, {"namespace": "Monitoring"}, {"honorLabels": "yes"},
     {"relabelings": [{"action": "rewrite"}]}, {"metricRelabelings": [{"source_labels": ["a"]}]}],
    ids=["timeout", "namespace", "honor-labels", "relabel-action", "relabel-field"],
)
def test_the_schema_refuses_a_bad_service_monitor(changes: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        _chart().validate_schema({"metrics": {"serviceMonitor": changes}})
