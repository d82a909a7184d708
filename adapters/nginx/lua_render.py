"""NGINX Lua mode's renderer (pure): a map as a `LuaPart`, the JSON text NGINX's Lua table stores
for it (and that text read back), and the checksum ome_table.lua keeps of the whole table."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from publisher.core.addresses import parse_endpoint
from publisher.core.values import Backend, MapKey, Route

# Mirrors MAX_BACKENDS in ome_table.lua, which refuses a longer entry on every push: checked in
# `problem()`, so such a map is InvalidPlan up front, not ApplyFailed and retried forever.
MAX_BACKENDS = 64
CHECKSUM_MODULUS = 2**52


@dataclass(frozen=True, slots=True)
class LuaBackend:
    cluster: str
    endpoint: str
    weight: int
    name: str  # the endpoint's host: what is resolved, and the SNI and (with rewrite_host) Host
    port: int


@dataclass(frozen=True, slots=True)
class LuaPart:
    """One map as the Lua table holds it, before its names are resolved to addresses."""

    hostname: str
    rewrite_host: bool
    backends: tuple[LuaBackend, ...]
    # The Route it was rendered from (None: read back from NGINX): a resync's read-back of 10,000
    # maps returns these instead of building 10,000 Routes and 40,000 Backends again.
    source: Route | None = field(default=None, compare=False, repr=False)

    def route(self) -> Route:
        if self.source is not None:
            return self.source
        return Route(self.hostname, tuple(Backend(b.cluster, b.endpoint, b.weight) for b in self.backends))


def _lua_backend(cluster: str, endpoint_url: str, weight: int) -> LuaBackend:
    endpoint = parse_endpoint(endpoint_url)
    return LuaBackend(cluster, endpoint_url, weight, endpoint.host.strip("[]"), endpoint.port)


class LuaRenderer:
    """Pure: a Route as a LuaPart. Lua mode picks the scheme per request, so a map may mix http
    and https backends."""

    def __init__(self, *, rewrite_host: bool = False) -> None:
        self._rewrite_host = rewrite_host

    def problem(self, key: MapKey, route: Route) -> str | None:
        """Everything ome_table.lua refuses that the shared checks let through."""
        if len(route.backends) > MAX_BACKENDS:
            return f"{len(route.backends)} backends, but the NGINX Lua table takes at most {MAX_BACKENDS} per map"
        for backend in route.backends:
            endpoint = parse_endpoint(backend.endpoint)
            if endpoint.path not in ("", "/"):
                return f"backends[{backend.cluster}].endpoint has path {endpoint.path!r}; NGINX proxies to the root only"
        return None

    def render(self, key: MapKey, route: Route) -> LuaPart:
        backends = tuple(_lua_backend(b.cluster, b.endpoint, b.weight) for b in route.backends)
        return LuaPart(route.hostname, self._rewrite_host, backends, route)


def entry_text(part: LuaPart, addresses: Mapping[str, tuple[str, ...]]) -> str:
    """The JSON text NGINX stores for one map, byte for byte (the checksum is computed on it):
    {"h": hostname, "r": rewrite_host, "b": [[cluster, endpoint, weight, [address, ...]], ...]}.
    Compact, as 10,000 of them travel in one batch; ome_table.lua derives scheme and port."""
    backends = [[b.cluster, b.endpoint, b.weight, list(addresses[b.name])] for b in part.backends]
    return json.dumps({"h": part.hostname, "r": part.rewrite_host, "b": backends}, separators=(",", ":"))


def decode_entry(text: str) -> tuple[LuaPart, dict[str, tuple[str, ...]]]:
    """An entry read back: the part and its addresses by name. Raises ValueError on anything
    `entry_text` did not write."""
    try:
        entry = json.loads(text)
        backends, addresses = [], {}
        for cluster, endpoint, weight, names in entry["b"]:
            backend = _lua_backend(str(cluster), str(endpoint), int(weight))
            backends.append(backend)
            addresses[backend.name] = tuple(str(address) for address in names)
        return LuaPart(str(entry["h"]), bool(entry["r"]), tuple(backends)), addresses
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a table entry: {exc!r}") from exc


def entry_hash(key: MapKey, text: str) -> int:
    return int(hashlib.md5(f"{key}\n{text}".encode()).hexdigest()[:13], 16)


def checksum(entries: Mapping[MapKey, str]) -> str:
    """The checksum ome_table.lua keeps of its table: the sum, mod 2^52, of the first 13 hex
    digits of md5("namespace/name\\n" + entry text) over every map; order does not matter."""
    return f"{sum(entry_hash(key, text) for key, text in entries.items()) % CHECKSUM_MODULUS:013x}"


def map_key(text: str) -> MapKey:
    namespace, _, name = text.partition("/")
    return MapKey(namespace, name)
