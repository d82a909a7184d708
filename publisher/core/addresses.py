"""The names and addresses a map and an option carry: endpoint URLs, hostnames, DNS names and labels,
HOST:PORT."""

from __future__ import annotations

import functools
import ipaddress
import re
from dataclasses import dataclass

# DNS-1123 subdomain: what Kubernetes accepts as an object name, and so as a WorkloadCluster name.
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# A DNS label (RFC 1123): a region's name, a namespace (tools/chart_limits.py builds the chart's pattern on it).
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# A hostname a gateway routes on: a lower-case DNS name, optionally a leading wildcard label.
_HOSTNAME = re.compile(r"^(\*\.)?[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?(\.[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)*$")
# An endpoint is http(s), a plain host (DNS name, IPv4 or bracketed IPv6), an optional port and an
# optional path of unreserved characters: nothing a gateway's config syntax could read as syntax.
_ENDPOINT = re.compile(
    r"^(?P<scheme>https?)://"
    r"(?P<host>[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?)*"
    r"|\[[0-9A-Fa-f:.]+\])"
    r"(:(?P<port>[0-9]{1,5}))?"
    r"(?P<path>/[A-Za-z0-9._~/-]*)?$"
)


@dataclass(frozen=True, slots=True)
class Endpoint:
    scheme: str
    host: str
    port: int
    path: str

    @property
    def tls(self) -> bool:
        return self.scheme == "https"


def split_host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{value!r} is not HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


# Each endpoint is checked when its map is read, again when a gateway checks and renders it, and
# again on every change of the map's weights: the IP parse alone made this a fifth of the CPU
# of a first publish at 10,000 maps. Pure, so one parse per distinct URL is enough.
@functools.lru_cache(maxsize=1 << 16)
def parse_endpoint(url: str) -> Endpoint:
    """Splits a validated endpoint URL; the port defaults to the scheme's. Raises ValueError.

    The host is an IP literal that `ipaddress` reads (IPv6 in brackets) or a DNS name of at most
    253 characters, labels of at most 63, whose last label is not all digits: `4294967295` or
    `010.0.0.1` would reach a resolver that may read them as other addresses."""
    match = _ENDPOINT.fullmatch(url)
    if match is None:
        raise ValueError(f"{url!r} is not an http(s) URL with a plain host")
    host_problem = _endpoint_host_problem(match["host"])
    if host_problem is not None:
        raise ValueError(f"{url!r}: {host_problem}")
    scheme = match["scheme"]
    port = int(match["port"]) if match["port"] else (443 if scheme == "https" else 80)
    if not 0 < port < 65536:
        raise ValueError(f"{url!r} has port {port}, outside 1..65535")
    return Endpoint(scheme=scheme, host=match["host"], port=port, path=match["path"] or "")


def _endpoint_host_problem(host: str) -> str | None:
    if host.startswith("["):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"{host} is not an IPv6 address"
        return None
    if _all_digit_label(host.rsplit(".", 1)[-1]):
        if is_canonical_ipv4(host):
            return None
        try:
            address = ipaddress.IPv4Address(host)
        except ValueError:
            return f"{host} looks numeric but is not a dotted-quad IPv4 address"
        if str(address) != host:
            return f"{host} is not in canonical dotted-quad form"
        return None
    return _dns_name_problem(host.lower())


_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_CANONICAL_IPV4 = re.compile(rf"{_OCTET}(?:\.{_OCTET}){{3}}")


def is_canonical_ipv4(host: str) -> bool:
    """A dotted quad as `ipaddress` writes it (no leading zeros): the common case, checked
    without ipaddress, whose parse was a third of rendering 10,000 maps."""
    return _CANONICAL_IPV4.fullmatch(host) is not None


def _all_digit_label(label: str) -> bool:
    return label.isdigit() or (label.lower().startswith("0x") and all(c in "0123456789abcdef" for c in label[2:].lower()))


def _dns_name_problem(name: str) -> str | None:
    if len(name) > 253:
        return f"a DNS name has at most 253 characters ({len(name)})"
    for label in name.split("."):
        if len(label) > 63:
            return f"DNS label {label[:20]}... has {len(label)} characters, at most 63"
    return None


def is_dns_label(value: str) -> bool:
    return bool(DNS_LABEL.fullmatch(value))


def is_dns_subdomain(value: str) -> bool:
    return len(value) <= 253 and bool(_DNS1123_SUBDOMAIN.fullmatch(value))


def is_hostname(value: str) -> bool:
    """A lower-case DNS name a gateway can route on (optionally `*.`); never all-numeric, so it
    cannot be read as an address."""
    if len(value) > 253 or not _HOSTNAME.fullmatch(value):
        return False
    return not _all_digit_label(value.rsplit(".", 1)[-1])
