"""NGINX in Lua mode: weights pushed into a running NGINX over its control listener, no reloads.

Owns: the pure renderer (a map -> `LuaPart`), the `http {}` snippet that loads the shipped Lua
modules (adapters/nginx/lua_modules/*.lua), filled in from adapters/nginx/templates/ome-lua.conf,
and `LuaTransport`: resolving endpoint names to IPs, pushing changed maps as one batch, confirming
each by the boot id, version and checksum NGINX answers, and re-pushing its confirmed table when
NGINX restarts (a new boot id). It writes no file, runs no `nginx -t` and never reloads. It must
not decide anything about maps: the engine does.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hashlib
import ipaddress
import json
import logging
import re
import shutil
import socket
import string
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from adapters.base import NotConnected, Rejected, Unavailable, WriteResult, in_words
from adapters.listen import check_nginx_listen
from adapters.nginx.counts import LuaRequestCounts
from adapters.nginx.options import NginxOptions
from adapters.timeouts import DEFAULT_ROUTE_IDLE_TIMEOUT, MAX_ROUTE_TIMEOUT, unit_duration
from publisher.core.addresses import parse_endpoint
from publisher.core.values import Backend, MapKey, Route

# The name it had before the move into adapters/nginx/: log filters keep working.
log = logging.getLogger("adapters.nginx_lua")

LUA_DIR = Path(__file__).with_name("lua_modules")
# The modules Debian's libnginx-mod-http-lua installs; load_module belongs in the main nginx.conf,
# outside http {} (Debian's package already adds them under /etc/nginx/modules-enabled/).
LOAD_MODULES = ("modules/ndk_http_module.so", "modules/ngx_http_lua_module.so")
DEFAULT_CA_FILE = Path("/etc/ssl/certs/ca-certificates.crt")
# The snippet `http_snippet` fills in, beside the Lua modules (package data). Its placeholders are
# @{name}: NGINX's own variables are $name, string.Template's default delimiter.
SNIPPET_TEMPLATE = Path(__file__).with_name("templates") / "ome-lua.conf"
# Mirrors MAX_ADDRESSES in ome_table.lua: more addresses only lengthen retries.
MAX_ADDRESSES = 16
# Mirrors MAX_BACKENDS in ome_table.lua, which refuses a longer entry on every push: checked in
# `problem()`, so such a map is InvalidPlan up front, not ApplyFailed and retried forever.
MAX_BACKENDS = 64
# Mirrors ome_control.lua's init, which stops NGINX on a shorter secret (whitespace around it left out).
SECRET_MIN_LENGTH = 16
_CHECKSUM_MODULUS = 2**52
# A lua_shared_dict size (--shared-dict-size, --counts-dict-size): NGINX's spelling in k or m, no
# leading zero, from 32k (NGINX refuses 1k and cannot allocate an 8k dict) to 1024m. The chart's
# values schema has this very pattern (tests/test_chart_limits.py).
SIZE_PATTERN = r"^((3[2-9]|[4-9][0-9]|[1-9][0-9]{2,5})k|([1-9][0-9]{0,2}|10[01][0-9]|102[0-4])m)$"
_SIZE = re.compile(SIZE_PATTERN)
# The characters a path in the snippet may have: nothing NGINX could read as syntax.
PATH_PATTERN = r"^[A-Za-z0-9_./+-]+$"

# DNS answers carry TTLs that getaddrinfo does not expose: names are re-resolved on this fixed
# interval instead, so an endpoint whose address moves is followed within half a minute.
RESOLVE_INTERVAL = 30.0
# getaddrinfo has no timeout of its own; a lookup still unanswered after this fails (and a known
# name keeps its last addresses).
RESOLVE_TIMEOUT = 5.0
# How often the transport asks NGINX for its boot id: a restart is repaired within about this
# plus one push (0.12 s for 10,000 maps).
POLL_INTERVAL = 0.25
# Below this share of free table bytes the transport warns, before batches start to be refused.
FREE_WARNING_SHARE = 0.1
# Until NGINX first answers (it may start after the sidecar), the read-back retries after this,
# doubling up to the cap; the cap also bounds serve()'s polls while NGINX does not answer.
FIRST_ANSWER_RETRY = 0.1
RETRY_CAP = 1.0

Resolver = Callable[[str, int], Awaitable[tuple[str, ...]]]


# --- Pure: the renderer, the entry text, the checksum, the snippet --------------------------------


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

    def route(self) -> Route:
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
        return LuaPart(route.hostname, self._rewrite_host, backends)


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


def _entry_hash(key: MapKey, text: str) -> int:
    return int(hashlib.md5(f"{key}\n{text}".encode()).hexdigest()[:13], 16)


def checksum(entries: Mapping[MapKey, str]) -> str:
    """The checksum ome_table.lua keeps of its table: the sum, mod 2^52, of the first 13 hex
    digits of md5("namespace/name\\n" + entry text) over every map; order does not matter."""
    return f"{sum(_entry_hash(key, text) for key, text in entries.items()) % _CHECKSUM_MODULUS:013x}"


def _map_key(text: str) -> MapKey:
    namespace, _, name = text.partition("/")
    return MapKey(namespace, name)


def secret_problem(path: Path) -> str | None:
    """Why NGINX would refuse the control secret in `path` at its start (missing, unreadable, or
    shorter than SECRET_MIN_LENGTH once stripped as ome_control.lua strips it), or None."""
    try:
        secret = path.read_bytes().strip()
    except FileNotFoundError:
        return "no such file"
    except OSError as exc:
        return f"cannot read it: {exc.strerror or exc}"
    if len(secret) < SECRET_MIN_LENGTH:
        return f"holds {len(secret)} characters; NGINX needs at least {SECRET_MIN_LENGTH}"
    return None


def copy_lua_modules(directory: Path) -> None:
    """This package's Lua modules copied into `directory` (made if missing), for an NGINX that does
    not see this package's files, e.g. in another container of the pod."""
    directory.mkdir(parents=True, exist_ok=True)
    if directory.resolve() == LUA_DIR.resolve():
        return  # already there
    for module in sorted(LUA_DIR.glob("*.lua")):
        shutil.copyfile(module, directory / module.name)


class _SnippetTemplate(string.Template):
    delimiter = "@"


@functools.cache
def _snippet_template() -> _SnippetTemplate:
    return _SnippetTemplate(SNIPPET_TEMPLATE.read_text(encoding="utf-8"))


def http_snippet(
    *,
    listen: str,
    control_listen: str,
    secret_file: Path,
    shared_dict_size: str = "32m",
    counts_dict_size: str | None = "8m",
    ca_file: Path | None = None,
    lua_dir: Path = LUA_DIR,
    idle_timeout: float = DEFAULT_ROUTE_IDLE_TIMEOUT,
) -> str:
    """The text to include inside `http {}`: the table, the catch-all server, the two upstreams
    and the control listener, with the Lua modules from `lua_dir` (this package's, or a copy where
    NGINX sees it: `copy_lua_modules`). `idle_timeout` (adapters.timeouts) bounds the wait between
    two reads or writes of a backend; there is no total deadline. Raises ValueError on a value
    NGINX would read as syntax."""
    check_nginx_listen(listen)
    check_nginx_listen(control_listen)
    for size in (shared_dict_size, counts_dict_size):
        if size is not None and not _SIZE.fullmatch(size):
            raise ValueError(f"{size!r} is not an NGINX size from 32k to 1024m, such as 32m")
    if not 0 < idle_timeout <= MAX_ROUTE_TIMEOUT:
        raise ValueError(f"idle timeout {idle_timeout:g}s is not between 1ms and 24h")
    ca_file = ca_file or DEFAULT_CA_FILE
    counts_dict = (
        ""
        if counts_dict_size is None
        else "# Request counts per map backend for the served-split check: about 131 bytes each (8m: ~60,000\n"
        f"# backends); a full dict evicts the oldest counter, which the sidecar reads as a restart.\nlua_shared_dict ome_counts {counts_dict_size};\n"
    )
    for path in (secret_file, ca_file, lua_dir):
        if not re.fullmatch(PATH_PATTERN, str(path)):
            raise ValueError(f"{str(path)!r}: only letters, digits and _./+- are allowed in a path here")
    return _snippet_template().substitute(
        load_modules="".join(f"#   load_module {module};\n" for module in LOAD_MODULES),
        lua_dir=lua_dir,
        shared_dict_size=shared_dict_size,
        counts_dict=counts_dict,
        secret_file=secret_file,
        listen=listen,
        idle_timeout=unit_duration(idle_timeout),
        ca_file=ca_file,
        control_listen=control_listen,
    )


# --- The transport ----------------------------------------------------------------------------------


@dataclass
class LuaStats:
    """What the transport did, for metrics: read it, never write it. pushes: batches NGINX
    confirmed; failures: the others and failed lookups, by reason; counters_evicted: request
    counters its request counter (LuaRequestCounts) saw evicted from a full dict."""

    pushes: int = 0
    failures: collections.Counter[str] = field(default_factory=collections.Counter)
    restarts_detected: int = 0
    counters_evicted: int = 0
    bytes_capacity: int | None = None
    bytes_free: int | None = None

    @property
    def bytes_used(self) -> int | None:
        if self.bytes_capacity is None or self.bytes_free is None:
            return None
        return self.bytes_capacity - self.bytes_free


async def resolve_name(name: str, port: int) -> tuple[str, ...]:
    """The addresses `name` resolves to (an IP literal is its own), sorted, at most MAX_ADDRESSES."""
    with contextlib.suppress(ValueError):
        return (str(ipaddress.ip_address(name)),)
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    addresses = sorted({str(info[4][0]) for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)})
    if not addresses:
        raise OSError(f"{name} has no address")
    return tuple(addresses[:MAX_ADDRESSES])


@functools.lru_cache(maxsize=65536)
def _ip_literal(name: str) -> tuple[str, ...] | None:
    """The address an IP literal names (it never moves, so it is never re-resolved), else None."""
    try:
        return (str(ipaddress.ip_address(name)),)
    except ValueError:
        return None


class _Refused(Exception):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(body.get("error", f"HTTP {status}"))
        self.status = status
        self.body = body


@contextlib.contextmanager
def _translated(doing: str) -> Iterator[None]:
    """The one place where control-listener I/O errors become adapter errors."""
    try:
        yield
    except (OSError, TimeoutError, aiohttp.ClientError, ValueError) as exc:
        raise Unavailable(f"nginx control listener: {doing}: {in_words(exc)}") from exc


class LuaTransport:
    """Pushes map entries into NGINX's Lua table; keeps the confirmed table to restore it.

    One lock orders every control request: the engine's writes and reads, and `serve()`, which
    polls the boot id (re-pushing the whole table after a restart) and re-resolves names. The
    checksum and the name cache are kept incrementally, so a write costs O(changed maps), and a
    read-back of a table NGINX still holds as confirmed reads no table.
    """

    def __init__(
        self,
        options: NginxOptions,
        *,
        resolve: Resolver = resolve_name,
        resolve_interval: float = RESOLVE_INTERVAL,
        poll_interval: float = POLL_INTERVAL,
        request_timeout: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert options.nginx_secret_file is not None  # NginxOptions requires it in lua mode
        self._url = options.nginx_control_url.rstrip("/")
        self._secret_file = options.nginx_secret_file
        self._resolve = resolve
        self._resolve_interval = resolve_interval
        self._poll_interval = poll_interval
        self._timeout = aiohttp.ClientTimeout(total=request_timeout)
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._secret: str | None = None
        self._lock = asyncio.Lock()
        # What NGINX confirmed it holds under boot id `_boot`; None: unknown, read it back first.
        self._boot: str | None = None
        self._version = 0
        self._entries: dict[MapKey, str] = {}
        self._parts: dict[MapKey, LuaPart] = {}  # the same maps, decoded
        # The boot id `_entries` were confirmed under: kept when `_boot` is forgotten, so a table
        # that no longer matches its checksum is repaired from them.
        self._entries_boot: str | None = None
        self._hashes: dict[MapKey, int] = {}
        self._sum = 0
        # name -> (addresses, when resolved): what the pushed entries use.
        self._names: dict[str, tuple[tuple[str, ...], float]] = {}
        # The failure of the last control request, None once one succeeds again.
        self._problem: str | None = None
        self._low_on_room = False
        self.stats = LuaStats()
        self.request_counter = LuaRequestCounts(self, instance=urllib.parse.urlsplit(self._url).netloc)

    # -- Transport protocol --

    async def read(self) -> dict[MapKey, Route]:
        """What NGINX serves. Until NGINX has answered once, this waits for it (the sidecar may
        start first), retrying with backoff; after that, a failure is Unavailable."""
        retry = FIRST_ANSWER_RETRY
        while True:
            async with self._lock:
                try:
                    if self._boot is None or not await self._unchanged():
                        await self._sync()
                    return {key: part.route() for key, part in self._parts.items()}
                except Unavailable as exc:
                    if self._entries_boot is not None:
                        raise
                    self._note_problem(str(exc))
            await asyncio.sleep(retry)
            retry = min(RETRY_CAP, retry * 2)

    async def write(self, parts: Mapping[MapKey, LuaPart], changes: Mapping[MapKey, LuaPart | None]) -> WriteResult:
        async with self._lock:
            if self._boot is None:
                try:
                    await self._sync()
                except Unavailable as exc:
                    if self._entries_boot is None:
                        raise NotConnected(f"nginx control listener has not answered yet: {exc}") from exc
                    raise
            rejected = await self._resolve_names(changes, force=frozenset())
            sets: dict[MapKey, str] = {}
            set_parts: dict[MapKey, LuaPart] = {}
            deletes: list[MapKey] = []
            for key, part in changes.items():
                if key in rejected:
                    continue
                if part is None:
                    if key in self._entries:
                        deletes.append(key)
                    continue
                text = self._entry_text(part)
                if self._entries.get(key) != text:
                    sets[key], set_parts[key] = text, part
            if sets or deletes:
                await self._push(sets, set_parts, deletes)
            return WriteResult(rejected=rejected)

    def hold_off(self) -> float:
        return 0.0

    def unready(self) -> str | None:
        """Only until NGINX first confirmed its table: after that, a control listener that does
        not answer is not a reason to be unready (NGINX keeps serving its table), and the loop's
        own window of three resync intervals without a confirmed pass decides."""
        if self._entries_boot is not None:
            return None
        waiting = "the NGINX control listener has not answered yet"
        return f"{waiting}: {self._problem}" if self._problem else waiting

    def refusals(self) -> Mapping[MapKey, str]:
        return {}

    async def serve(self) -> None:
        """Until cancelled: watch the boot id and restore the table after a restart; re-resolve
        names every resolve interval and push the maps whose addresses moved."""
        delay = self._poll_interval
        while True:
            try:
                async with self._lock:
                    await self._check_boot()
                    await self._refresh_names()
                delay = self._poll_interval
            except (Unavailable, Rejected) as exc:
                self._note_problem(str(exc))
                # An NGINX that does not answer, or refuses the restore, is asked less often.
                delay = min(max(RETRY_CAP, self._poll_interval), delay * 2)
            await asyncio.sleep(delay)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- For the request counter (adapters.nginx.counts), without the lock --

    def confirmed_maps(self) -> list[MapKey]:
        return list(self._parts)

    def confirmed_clusters(self, key: MapKey) -> list[str] | None:
        # The maps as they are now (a restore replaces the dict). A list: a tuple made from a
        # generator leaves more objects for the collector per page (test_nginx_lua_counts).
        part = self._parts.get(key)
        return None if part is None else [backend.cluster for backend in part.backends]

    async def exchange(self, method: str, path: str, body: str | None = None) -> tuple[int, dict[str, Any], str]:
        """One control request: its status, the answer's first line (a JSON object) and the rest.
        Changes nothing but the session and the secret it reads once."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        if self._secret is None:
            with _translated(f"read the secret file {self._secret_file}"):
                self._secret = (await asyncio.to_thread(self._secret_file.read_text)).strip()
        headers = {"Authorization": f"Bearer {self._secret}", "Content-Type": "text/plain"}
        with _translated(f"{method} {path}"):
            async with self._session.request(method, self._url + path, data=body, headers=headers) as response:
                text = await response.text()
                status = response.status
            head, _, rest = text.partition("\n")
            answer = json.loads(head)
        if not isinstance(answer, dict):
            raise Unavailable(f"nginx control listener: {method} {path}: answered {answer!r}")
        return status, answer, rest

    # -- Internals (called with the lock held) --

    async def _request(self, method: str, path: str, body: str | None = None) -> tuple[dict[str, Any], str]:
        """The answer's first line (a JSON object) and the rest of it."""
        status, answer, rest = await self.exchange(method, path, body)
        self._note_room(answer)
        if status == 401:
            # The secret file may have been rotated: read it again next time.
            self._secret = None
            self.stats.failures["unauthorized"] += 1
            raise Unavailable("nginx control listener refused the shared secret")
        if status != 200:
            raise _Refused(status, answer)
        self._note_problem(None)
        return answer, rest

    async def _sync(self) -> None:
        """Make `_entries` what NGINX holds: restore it after a restart, else adopt what it serves."""
        answer, lines = await self._request("GET", "/table")
        boot = str(answer.get("boot"))
        if self._boot is not None and boot != self._boot:
            await self._restore(boot)
            return
        entries: dict[MapKey, str] = {}
        parts: dict[MapKey, LuaPart] = {}
        names: dict[str, tuple[str, ...]] = {}
        try:
            for line in lines.splitlines():
                name, _, text = line.partition(" ")
                key = _map_key(name)
                parts[key], addresses = decode_entry(text)
                names.update(addresses)
                entries[key] = text
        except ValueError as exc:
            raise Unavailable(f"nginx control listener: the table does not read back: {exc!r}") from exc
        hashes = {key: _entry_hash(key, text) for key, text in entries.items()}
        total = sum(hashes.values()) % _CHECKSUM_MODULUS
        now = self._clock()
        for name, addresses in names.items():
            if _ip_literal(name) is None:
                self._names.setdefault(name, (addresses, now))
        if f"{total:013x}" != answer.get("checksum"):
            await self._repair(boot, entries, parts)
            return
        self._boot, self._version, self._sum = boot, int(answer.get("version", 0)), total
        self._entries, self._parts, self._hashes, self._entries_boot = entries, parts, hashes, boot

    async def _repair(self, boot: str, entries: dict[MapKey, str], parts: dict[MapKey, LuaPart]) -> None:
        """The table does not match its own checksum (a batch NGINX could not undo, a hand edit):
        replace it whole by what NGINX last confirmed to us under this boot, or, with nothing
        confirmed yet, by the entries it holds, so its checksum, hostnames and entries agree again."""
        if self._entries_boot == boot:
            entries, parts = dict(self._entries), dict(self._parts)
        log.warning("nginx table does not match its checksum: replacing it whole", extra={"boot": boot, "maps": len(entries)})
        await self._push(entries, parts, [], boot=boot, replace=True)
        log.info("nginx table repaired", extra={"boot": boot, "maps": len(entries)})

    async def _unchanged(self) -> bool:
        """Whether NGINX holds exactly what it confirmed to us (boot, version, checksum), asked of
        /changes: a resync's read-back of 10,000 unchanged maps is then one small answer, not the
        whole table parsed on the event loop (0.6 s)."""
        try:
            answer, changes = await self._request("GET", f"/changes?boot={self._boot}&since={self._version}")
        except _Refused:
            return False  # 410: another boot, or the change log no longer reaches our version
        confirmed = answer.get("version") == self._version and answer.get("checksum") == f"{self._sum:013x}"
        return confirmed and not changes.strip()

    async def _check_boot(self) -> None:
        answer, _ = await self._request("GET", "/state")
        boot = str(answer.get("boot"))
        if self._boot is None:
            return
        if boot != self._boot:
            await self._restore(boot)
        elif answer.get("checksum") != f"{self._sum:013x}":
            # Someone else wrote the table: adopt what it holds; the engine's resync repairs it.
            log.warning("nginx table changed outside the sidecar", extra={"boot": boot})
            self._boot = None
            await self._sync()

    async def _restore(self, boot: str) -> None:
        """NGINX restarted (a new boot id, an empty table): push the whole confirmed table. Until
        NGINX confirms it, the table stays ours to restore."""
        self.stats.restarts_detected += 1
        log.warning("nginx restart detected", extra={"boot": boot, "previous_boot": self._boot, "maps": len(self._entries)})
        await self._push(dict(self._entries), dict(self._parts), [], boot=boot, replace=True)
        log.info("nginx table restored", extra={"boot": boot, "maps": len(self._entries)})

    async def _push(
        self,
        sets: Mapping[MapKey, str],
        parts: Mapping[MapKey, LuaPart],
        deletes: list[MapKey],
        *,
        boot: str | None = None,
        replace: bool = False,
    ) -> None:
        """One batch (`sets` are entry texts, `parts` the same maps decoded); returns once NGINX
        confirmed it by boot id, version and checksum."""
        boot = boot or self._boot
        hashes = {key: _entry_hash(key, text) for key, text in sets.items()}
        if replace:
            expected_sum = sum(hashes.values()) % _CHECKSUM_MODULUS
        else:
            expected_sum = self._sum + sum(hashes.values())
            expected_sum -= sum(self._hashes.get(key, 0) for key in (*sets, *deletes))
            expected_sum %= _CHECKSUM_MODULUS
        # The format ome_table.parse_batch reads: a JSON head line, then one line per change.
        lines = [json.dumps({"expect_boot": boot, "replace": replace})]
        lines += [f"set {key} {text}" for key, text in sets.items()]
        lines += [f"delete {key}" for key in deletes]
        try:
            answer, _ = await self._request("POST", "/batch", "\n".join(lines))
        except _Refused as refused:
            if refused.status == 409 and not replace:
                # A restart between our last look and this batch: restore, then apply the batch.
                await self._restore(str(refused.body.get("boot")))
                return await self._push(sets, parts, deletes)
            reason = {400: "invalid", 507: "table_full"}.get(refused.status, f"http_{refused.status}")
            self.stats.failures[reason] += 1
            log.warning("nginx refused batch", extra={"reason": reason, "maps": len(sets) + len(deletes), "error": str(refused)})
            if replace:
                # A whole table the engine confirmed, refused (a restart with a smaller dict): no
                # map is to blame, and splitting it would only refuse each map in turn.
                raise Unavailable(f"nginx refused the whole confirmed table: {refused}") from None
            if refused.status in (400, 507):
                raise Rejected(f"nginx refused the batch: {refused}") from None
            # What NGINX holds is unknown (a 500: a batch it could not undo): read it whole.
            self._boot = None
            raise Unavailable(f"nginx control listener: {refused}") from None
        except Unavailable:
            self.stats.failures["unreachable"] += 1
            raise
        version = int(answer.get("version", 0))
        previous = 0 if replace else self._version
        if answer.get("boot") != boot or version <= previous or answer.get("checksum") != f"{expected_sum:013x}":
            self.stats.failures["unconfirmed"] += 1
            # What NGINX holds is unknown now: forget the boot so the next call reads it back.
            self._boot = None
            raise Unavailable(f"nginx did not confirm the batch (answered {answer!r})")
        if replace:
            self._entries, self._parts, self._hashes = {}, {}, {}
        for key in deletes:
            del self._entries[key], self._parts[key], self._hashes[key]
        self._entries.update(sets)
        self._parts.update(parts)
        self._hashes.update(hashes)
        self._boot, self._version, self._sum, self._entries_boot = boot, version, expected_sum, boot
        self.stats.pushes += 1

    def _entry_text(self, part: LuaPart) -> str:
        return entry_text(part, {b.name: _ip_literal(b.name) or self._names[b.name][0] for b in part.backends})

    async def _resolve_names(self, changes: Mapping[MapKey, LuaPart | None], *, force: frozenset[str]) -> dict[MapKey, str]:
        """Resolve, concurrently, every name of `changes` not known or due (or in `force`); the
        maps whose names do not resolve, with why. A name keeps its last addresses until a lookup
        succeeds (fail static)."""
        now = self._clock()
        # One lookup per name, whatever its ports; an IP literal is its own address, never looked up.
        wanted = {b.name: b.port for part in changes.values() if part is not None for b in part.backends}
        due = sorted(
            (name, port) for name, port in wanted.items()
            if (name in force or name not in self._names or now - self._names[name][1] > self._resolve_interval)
            and _ip_literal(name) is None
        )  # fmt: skip
        lookups = (asyncio.wait_for(self._resolve(name, port), RESOLVE_TIMEOUT) for name, port in due)
        results = await asyncio.gather(*lookups, return_exceptions=True)
        failed: dict[str, str] = {}
        for (name, _), result in zip(due, results):
            if isinstance(result, BaseException):
                if not isinstance(result, (OSError, UnicodeError)):
                    raise result
                if name not in self._names:
                    failed[name] = f"cannot resolve {name}: {result}"
            else:
                self._names[name] = (result, now)
        if failed:
            self.stats.failures["resolve"] += len(failed)
        rejected: dict[MapKey, str] = {}
        for key, part in changes.items():
            reasons = [failed[b.name] for b in part.backends if b.name in failed] if part else []
            if reasons:
                rejected[key] = reasons[0]
        return rejected

    async def _refresh_names(self) -> None:
        """Re-resolve the names that are due; push the maps whose addresses moved."""
        if self._boot is None:
            return
        now = self._clock()
        due = frozenset(name for name, (_, at) in self._names.items() if now - at > self._resolve_interval)
        if not due:
            return
        affected = {key: part for key, part in self._parts.items() if any(b.name in due for b in part.backends)}
        await self._resolve_names(affected, force=due)
        for name in due:
            addresses, at = self._names[name]
            self._names[name] = (addresses, max(at, now))
        sets = {key: text for key, part in affected.items() if (text := self._entry_text(part)) != self._entries[key]}
        if sets:
            log.info("nginx endpoint addresses moved", extra={"maps": len(sets)})
            await self._push(sets, {key: affected[key] for key in sets}, [])
        unused = set(self._names) - {b.name for key in affected for b in affected[key].backends}
        for name in unused & due:
            del self._names[name]

    def _note_room(self, answer: Mapping[str, Any]) -> None:
        capacity, free = answer.get("bytes_capacity"), answer.get("bytes_free")
        if not isinstance(capacity, int) or not isinstance(free, int) or capacity <= 0:
            return
        self.stats.bytes_capacity, self.stats.bytes_free = capacity, free
        low = free < capacity * FREE_WARNING_SHARE
        if low and not self._low_on_room:
            log.warning("nginx table almost full", extra={"bytes_free": free, "bytes_capacity": capacity})
        self._low_on_room = low

    def _note_problem(self, reason: str | None) -> None:
        if reason is not None and self._problem is None:
            log.warning("nginx control listener unavailable", extra={"error": reason})
        elif reason is None and self._problem is not None:
            log.info("nginx control listener answering again")
        self._problem = reason


def build(options: NginxOptions) -> tuple[LuaRenderer, LuaTransport]:
    """Lua mode's renderer and transport, for adapters.engine.Engine."""
    return LuaRenderer(rewrite_host=options.rewrite_host), LuaTransport(options)
