"""NGINX reload mode's renderer (pure): one map's Route as its read-back line and its
upstream/server blocks (no generation: a generation-only change renders the same text), the whole
file assembled from those parts with its version, and the file read back (adapters.nginx.reload
writes it, reloads NGINX and confirms)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from adapters.base import duplicate_hostname, publication_problem
from adapters.listen import check_nginx_listen
from adapters.nginx.options import VERSION_PATH
from adapters.route_json import from_json as route_from_json
from adapters.route_json import to_json as route_json
from adapters.timeouts import DEFAULT_ROUTE_IDLE_TIMEOUT, unit_duration
from publisher.core.addresses import parse_endpoint
from publisher.core.values import MapKey, Publication, Route

ROUTE_PREFIX = "# ome-route "
# Files written before routes left provenance out carry the whole Publication; still read back.
LEGACY_PREFIX = "# ome-publication "
VERSION_PREFIX = "# version "

# split_clients takes percentages with two decimals: the whole is 10,000 hundredths of a percent.
SPLIT_UNITS = 10_000


def shared_problem(key: MapKey, route: Route) -> str | None:
    """The strict checks every adapter shares (adapters.base.publication_problem), for a Route."""
    return publication_problem(Publication(key.namespace, key.name, route.hostname, 0, 0, route.backends))


def nginx_problem(route: Route, *, rewrite_host: bool = False) -> str | None:
    """What NGINX cannot express about a route that passed the shared checks, or None."""
    schemes: set[str] = set()
    for backend in route.backends:
        endpoint = parse_endpoint(backend.endpoint)
        if endpoint.path not in ("", "/"):
            return f"backends[{backend.cluster}].endpoint has path {endpoint.path!r}; NGINX proxies to the root only"
        schemes.add(endpoint.scheme)
    if len(schemes) > 1 and not rewrite_host:
        return "backends mix http and https endpoints; one NGINX upstream has one scheme (use --rewrite-host)"
    return None


def route_problem(key: MapKey, route: Route, *, rewrite_host: bool = False) -> str | None:
    """Why a route cannot be written into an NGINX config, or None. Every written value passes here."""
    return shared_problem(key, route) or nginx_problem(route, rewrite_host=rewrite_host)


def split_units(weights: Iterable[int]) -> list[int]:
    """Each weight's share in hundredths of a percent, summing to 10,000 (or 0 when all are 0).

    Largest remainder: every share is within one hundredth of a percent of the exact one.
    """
    weights = list(weights)
    total = sum(weights)
    if total == 0:
        return [0] * len(weights)
    units = [w * SPLIT_UNITS // total for w in weights]
    remainders = sorted(range(len(weights)), key=lambda i: (-(weights[i] * SPLIT_UNITS % total), i))
    for i in remainders[: SPLIT_UNITS - sum(units)]:
        units[i] += 1
    return units


def _upstream_name(key: MapKey, index: int | None = None) -> str:
    # Namespaces and names hold no "_", so "_" separates them unambiguously.
    base = f"ome_{key.namespace}_{key.name}"
    return base if index is None else f"{base}_{index}"


def _variable_stem(key: MapKey) -> str:
    # NGINX variable names take no "." or "-": a digest of the key stands in for it.
    return "ome_" + hashlib.sha256(f"{key.namespace}/{key.name}".encode()).hexdigest()[:16]


def _server_line(backend_endpoint: str, weight: int) -> str:
    endpoint = parse_endpoint(backend_endpoint)
    return f"    server {endpoint.host}:{endpoint.port} {f'weight={weight}' if weight else 'down'};\n"


def _proxy_common(idle_timeout: float) -> str:
    """What every proxied location sets: keep-alive to the backends; each byte passed on as it
    comes (an LLM stream's tokens are not held in a buffer); and the idle timeout (adapters.timeouts)
    between two reads or writes of the backend, where NGINX's default is 60 s. NGINX has no total
    deadline."""
    idle = unit_duration(idle_timeout)
    return (
        "        proxy_http_version 1.1;\n"
        '        proxy_set_header Connection "";\n'
        "        proxy_buffering off;\n"
        f"        proxy_read_timeout {idle};\n"
        f"        proxy_send_timeout {idle};\n"
    )


@dataclass(frozen=True, slots=True)
class NginxPart:
    """One map's share of the file: its hostname (one server_name per file) and its text."""

    hostname: str
    text: str


def render_part(
    key: MapKey, route: Route, *, listen: str, rewrite_host: bool = False, idle_timeout: float = DEFAULT_ROUTE_IDLE_TIMEOUT
) -> NginxPart:
    """The config text of one map: its read-back line, upstream(s) and server block.

    Raises ValueError for a route `route_problem()` refuses: nothing unchecked reaches the file.
    """
    reason = route_problem(key, route, rewrite_host=rewrite_host)
    if reason is not None:
        raise ValueError(f"{key}: {reason}")
    out = [ROUTE_PREFIX, json.dumps(route_json(key, route), separators=(",", ":"), sort_keys=True), "\n"]
    server_head = f"server {{\n    listen {listen};\n    server_name {route.hostname};\n    location / {{\n"
    if route.all_zero:
        out += [server_head, "        return 503;\n    }\n}\n"]
        return NginxPart(route.hostname, "".join(out))
    if not rewrite_host:
        name = _upstream_name(key)
        out.append(f"upstream {name} {{\n")
        out += [_server_line(b.endpoint, b.weight) for b in route.backends]
        out.append("}\n")
        scheme = parse_endpoint(route.backends[0].endpoint).scheme
        out += [server_head, f"        proxy_pass {scheme}://{name};\n", "        proxy_set_header Host $host;\n"]
        if scheme == "https":
            out.append("        proxy_ssl_server_name on;\n        proxy_ssl_name $host;\n")
        out += [_proxy_common(idle_timeout), "    }\n}\n"]
        return NginxPart(route.hostname, "".join(out))
    stem = _variable_stem(key)
    units = split_units(b.weight for b in route.backends)
    targets, hosts, splits = [], [], []
    for index, (backend, unit) in enumerate(zip(route.backends, units)):
        endpoint = parse_endpoint(backend.endpoint)
        name = _upstream_name(key, index)
        out.append(f"upstream {name} {{\n{_server_line(backend.endpoint, backend.weight)}}}\n")
        targets.append(f"    {index} {endpoint.scheme}://{name};\n")
        hosts.append(f"    {index} {endpoint.host};\n")
        if unit:
            splits.append(f"    {unit // 100}.{unit % 100:02d}% {index};\n")
    out += [f'split_clients "$request_id" ${stem} {{\n', *splits, "}\n"]
    out += [f"map ${stem} ${stem}_target {{\n", *targets, "}\n"]
    out += [f"map ${stem} ${stem}_host {{\n", *hosts, "}\n"]
    out += [
        server_head,
        f"        proxy_pass ${stem}_target;\n",
        f"        proxy_set_header Host ${stem}_host;\n",
        f"        proxy_ssl_server_name on;\n        proxy_ssl_name ${stem}_host;\n",
        _proxy_common(idle_timeout),
        "    }\n}\n",
    ]
    return NginxPart(route.hostname, "".join(out))


def assemble(parts: Mapping[MapKey, NginxPart], *, listen: str, status_listen: str) -> tuple[str, str]:
    """The whole file from rendered parts in key order, and its version (a digest of the content,
    so an unchanged file keeps its version across restarts). ValueError for two maps with one
    server_name."""
    check_nginx_listen(listen)
    check_nginx_listen(status_listen)
    duplicate = duplicate_hostname(parts, "server_name")
    if duplicate is not None:
        raise ValueError(duplicate)
    body = [
        "# Requests for hostnames no map publishes reach no backend.\n",
        f"server {{\n    listen {listen} default_server;\n    server_name _;\n    return 404;\n}}\n",
    ]
    body += [parts[key].text for key in sorted(parts)]
    text = "".join(body)
    version = hashlib.sha256(text.encode()).hexdigest()[:16]
    head = (
        "# Written by ome-gateway-publisher; rewritten on every change, do not edit. Include inside http {}.\n"
        f"{VERSION_PREFIX}{version}\n"
        f"server {{\n    listen {status_listen};\n"
        f"    location = {VERSION_PATH} {{\n        default_type text/plain;\n        return 200 \"{version}\\n\";\n    }}\n"
        "    location / {\n        return 404;\n    }\n}\n"
    )
    return head + text, version


def render(
    routes: Mapping[MapKey, Route],
    *,
    listen: str = "8080",
    status_listen: str = "127.0.0.1:8081",
    rewrite_host: bool = False,
    idle_timeout: float = DEFAULT_ROUTE_IDLE_TIMEOUT,
) -> str:
    """The whole file for `routes`. Raises ValueError for a route `route_problem()` refuses."""
    parts = {
        key: render_part(key, route, listen=listen, rewrite_host=rewrite_host, idle_timeout=idle_timeout)
        for key, route in routes.items()
    }
    return assemble(parts, listen=listen, status_listen=status_listen)[0]


def read_back(text: str, *, idle_timeout: float | None = None) -> tuple[dict[MapKey, Route], list[str]]:
    """The routes a file holds, and one message per line that is not a valid one. With
    `idle_timeout`, a map that proxies with another one (an older sidecar's, or other options) is
    left out: to the engine it is not served, and it is written again."""
    routes: dict[MapKey, Route] = {}
    problems: list[str] = []
    # The proxy timeouts in the lines that follow each map's read-back line, None for a map that
    # answers without a backend (503).
    timeouts: dict[MapKey, set[str] | None] = {}
    current: MapKey | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.startswith((ROUTE_PREFIX, LEGACY_PREFIX)):
            stripped = line.strip()
            if current is not None and stripped.startswith(("proxy_pass ", "proxy_read_timeout ", "proxy_send_timeout ")):
                held = timeouts.get(current) or set()
                timeouts[current] = held if stripped.startswith("proxy_pass ") else held | {stripped}
            continue
        current = None
        try:
            if line.startswith(ROUTE_PREFIX):
                key, route = route_from_json(json.loads(line[len(ROUTE_PREFIX) :]))
            else:
                pub = Publication.from_json(json.loads(line[len(LEGACY_PREFIX) :]))
                key, route = pub.key, pub.route
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            problems.append(f"line {number}: {exc}")
            continue
        reason = route_problem(key, route, rewrite_host=True)
        if reason is not None:
            problems.append(f"line {number}: {reason}")
            continue
        routes[key], current, timeouts[key] = route, key, None
    if idle_timeout is not None:
        wanted = {f"proxy_{way}_timeout {unit_duration(idle_timeout)};" for way in ("read", "send")}
        routes = {key: route for key, route in routes.items() if timeouts[key] in (None, wanted)}
    return routes, problems


def version_of(text: str) -> str | None:
    for line in text.splitlines()[:5]:
        if line.startswith(VERSION_PREFIX):
            return line[len(VERSION_PREFIX) :].strip()
    return None


@dataclass(frozen=True)
class NginxRenderer:
    """The `Renderer` of reload mode: one map's text part. Pure."""

    listen: str = "8080"
    rewrite_host: bool = False
    idle_timeout: float = DEFAULT_ROUTE_IDLE_TIMEOUT

    def problem(self, key: MapKey, route: Route) -> str | None:
        return nginx_problem(route, rewrite_host=self.rewrite_host)

    def render(self, key: MapKey, route: Route) -> NginxPart:
        return render_part(key, route, listen=self.listen, rewrite_host=self.rewrite_host, idle_timeout=self.idle_timeout)
