"""Test certificates made with `cryptography`: a certificate authority that issues server and
client certificates (an hour long, EC P-256), written as PEM files into a test's tmp_path."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["Authority", "Issued", "MutualTls", "mutual_tls"]

_LIFETIME = datetime.timedelta(hours=1)


@dataclass(frozen=True)
class Issued:
    """One certificate and its key, as files."""

    cert: Path
    key: Path


class Authority:
    """A self-signed CA; `issue` writes a leaf certificate and key signed by it."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory, self.name = directory, name
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + _LIFETIME)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.cert = directory / f"{name}-ca.pem"
        self.cert.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, *, dns: tuple[str, ...] = (), ips: tuple[str, ...] = (), client: bool = False) -> Issued:
        """A leaf certificate for `name` with the given subject alternative names, for a server
        (serverAuth) or, with `client`, a client (clientAuth)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + _LIFETIME)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
            )
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        issued = Issued(self.directory / f"{name}.pem", self.directory / f"{name}-key.pem")
        issued.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        issued.key.write_bytes(
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
        return issued


@dataclass(frozen=True)
class MutualTls:
    """One CA's server certificate (for localhost and 127.0.0.1) and client certificate."""

    ca: Authority
    server: Issued
    client: Issued


def mutual_tls(directory: Path, name: str = "ome", *, server_dns: str = "localhost") -> MutualTls:
    """A CA named `name` in `directory` with a server and a client certificate it signed."""
    ca = Authority(directory, name)
    server = ca.issue(f"{name}-server", dns=(server_dns,), ips=("127.0.0.1",))
    client = ca.issue(f"{name}-client", client=True)
    return MutualTls(ca, server, client)
