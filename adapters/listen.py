"""Listen-address checks the gateways share: NGINX's listen syntax (reload and Lua mode), and
whether an address can be bound now (the sidecar's gRPC servers ask before binding)."""

from __future__ import annotations

import ipaddress
import re
import socket

__all__ = ["bind_problem", "check_nginx_listen", "is_loopback", "nginx_listen_parts"]

_NGINX_LISTEN = re.compile(r"^((?P<host>\*|[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]):)?(?P<port>[0-9]{1,5})$")


def nginx_listen_parts(value: str) -> tuple[str | None, str]:
    """Pure: the host (None when only a port is given) and port of an NGINX listen address
    (PORT or HOST:PORT). ValueError for anything else."""
    match = _NGINX_LISTEN.fullmatch(value)
    if match is None or not 0 < int(match["port"]) < 65536:
        raise ValueError(f"{value!r} is not an NGINX listen address (PORT or HOST:PORT)")
    return match["host"], match["port"]


def check_nginx_listen(value: str) -> str:
    """Pure: `value`, when it is an NGINX listen address; ValueError otherwise (a pydantic validator)."""
    nginx_listen_parts(value)
    return value


def bind_problem(listen: str) -> str | None:
    """Why `listen` cannot be bound, in the kernel's words, or None. Asked before gRPC binds: a
    failed gRPC bind prints gRPC's own lines on stderr before ours, and names no reason."""
    host, _, port = listen.rpartition(":")
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, int(port), type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            # As gRPC binds: a port whose last connections linger in TIME_WAIT is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as exc:
        return exc.strerror or str(exc)
    except ValueError:
        return "not HOST:PORT"
    return None


def is_loopback(host: str) -> bool:
    """Pure: whether a listen host stays inside the machine (the pod): `localhost`, or an IP
    literal in 127.0.0.0/8 or ::1. Any other name counts as leaving it, as its address is not
    known without resolving it; an empty host or `0.0.0.0` binds every interface."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback
