"""Mutual TLS for the sidecar's gRPC servers (xDS, file mode's LRS) when they leave the pod: the
certificate, key and client CA files, checked at start, and gRPC credentials that read them again
when they change (a Kubernetes Secret is remounted by swapping a symlink: the files' inodes change).

Owns the last good certificate set it loaded. Imports the standard library and grpc only.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

__all__ = ["CERT_FLAG", "CLIENT_CA_FLAG", "KEY_FLAG", "ServerTls", "ServerTlsFiles"]

log = logging.getLogger(__name__)

CERT_FLAG = "--envoy-xds-tls-cert"
KEY_FLAG = "--envoy-xds-tls-key"
CLIENT_CA_FLAG = "--envoy-xds-client-ca"


@dataclass(frozen=True)
class ServerTlsFiles:
    """The server's certificate (chain), its private key, and the CA that signs client certificates."""

    cert: Path
    key: Path
    client_ca: Path


@dataclass(frozen=True)
class _Pem:
    cert: bytes
    key: bytes
    client_ca: bytes


def _read(path: Path, flag: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, f"{flag} {path}") from None


def _load(files: ServerTlsFiles) -> _Pem:
    """The three files, read and checked: each certificate file holds PEM certificates, and the key
    is the certificate's, unencrypted. OSError naming the flag and path otherwise (the start-up
    one line: `--envoy-xds-tls-key /etc/tls/tls.key: not the private key of ...`)."""
    pem = _Pem(_read(files.cert, CERT_FLAG), _read(files.key, KEY_FLAG), _read(files.client_ca, CLIENT_CA_FLAG))
    for data, flag, path in ((pem.cert, CERT_FLAG, files.cert), (pem.client_ca, CLIENT_CA_FLAG, files.client_ca)):
        try:
            ssl.create_default_context().load_verify_locations(cadata=data.decode("ascii"))
        except (ssl.SSLError, UnicodeDecodeError, ValueError):
            raise OSError(None, "holds no PEM certificate", f"{flag} {path}") from None
    try:
        # A password that is never right: an encrypted key fails here instead of OpenSSL prompting.
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(files.cert, files.key, password=lambda: b"")
    except (ssl.SSLError, OSError):
        raise OSError(None, f"not an unencrypted PEM private key of the certificate in {CERT_FLAG} {files.cert}", f"{KEY_FLAG} {files.key}") from None
    return pem


def _signature(files: ServerTlsFiles) -> tuple[tuple[int, int, int], ...] | None:
    """What changes when any of the files is replaced or rewritten (stat follows the symlinks)."""
    try:
        return tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in (os.stat(p) for p in (files.cert, files.key, files.client_ca)))
    except OSError:
        return None


def _configuration(pem: _Pem) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration([(pem.key, pem.cert)], root_certificates=pem.client_ca)


class ServerTls:
    """Server credentials requiring a client certificate signed by the client CA. The files are
    read and checked when made (OSError naming the flag otherwise); then before each TLS handshake
    gRPC asks whether they changed, and a complete, valid new set is used from that handshake on.
    A set that fails the checks (a Secret caught half-written) is logged and the last good one kept."""

    def __init__(self, files: ServerTlsFiles) -> None:
        self.files = files
        self._signature = _signature(files)
        self._initial = _load(files)
        self.reloads = 0
        # gRPC calls the fetcher from its own threads.
        self._lock = threading.Lock()

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            _configuration(self._initial), self._fetch, require_client_authentication=True
        )

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's question before each handshake: a new configuration, or None to keep the current one."""
        with self._lock:
            signature = _signature(self.files)
            if signature is None or signature == self._signature:
                return None
            self._signature = signature
            try:
                pem = _load(self.files)
            except OSError as exc:
                log.warning("tls files changed but are not usable; keeping the last good ones", extra={"error": f"{exc.filename}: {exc.strerror}"})
                return None
            self.reloads += 1
        log.info("tls certificate reloaded", extra={"cert": str(self.files.cert)})
        return _configuration(pem)
