"""NGINX in Lua mode: weights pushed into a running NGINX over its control listener, no reloads.

Owns `LuaTransport`: resolving endpoint names to IPs, pushing changed maps as one batch, confirming
each by the boot id, version and checksum NGINX answers, and re-pushing its confirmed table when
NGINX restarts (a new boot id); and `ControlClient`, the control listener's HTTP client with its
secret. It writes no file, runs no `nginx -t` and never reloads. It must not decide anything about
maps: the engine does. Its pure parts: the renderer (adapters.nginx.lua_render), the confirmed
table and its batches (lua_table), the name cache (lua_names); the `http {}` snippet NGINX loads
is adapters.nginx.lua_snippet.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import json
import logging
import socket
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from adapters.base import NotConnected, Rejected, TransportDefaults, Unavailable, WriteResult, in_words
from adapters.nginx.counts import LuaRequestCounts
from adapters.nginx.lua_names import RESOLVE_INTERVAL, NameCache, rejected_maps
from adapters.nginx.lua_render import LuaPart, LuaRenderer, entry_text
from adapters.nginx.lua_table import Batch, ConfirmedTable, TableRead, read_table
from adapters.nginx.options import NginxOptions
from publisher.core.values import MapKey, Route

# The name it had before the move into adapters/nginx/: log filters keep working.
log = logging.getLogger("adapters.nginx_lua")

# Mirrors MAX_ADDRESSES in ome_table.lua: more addresses only lengthen retries.
MAX_ADDRESSES = 16
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
# A read-back gives the event loop back after each slice of this many maps.
READ_SLICE = 256

Resolver = Callable[[str, int], Awaitable[tuple[str, ...]]]


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


class ControlClient:
    """NGINX's control listener over HTTP, with the shared secret from its file, read once (again
    after `forget_secret`)."""

    def __init__(self, url: str, secret_file: Path, *, request_timeout: float) -> None:
        self.url = url
        self._secret_file = secret_file
        self._timeout = aiohttp.ClientTimeout(total=request_timeout)
        self._session: aiohttp.ClientSession | None = None
        self._secret: str | None = None

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
            async with self._session.request(method, self.url + path, data=body, headers=headers) as response:
                text = await response.text()
                status = response.status
            head, _, rest = text.partition("\n")
            answer = json.loads(head)
        if not isinstance(answer, dict):
            raise Unavailable(f"nginx control listener: {method} {path}: answered {answer!r}")
        return status, answer, rest

    def forget_secret(self) -> None:
        """The secret file may have been rotated: read it again next time."""
        self._secret = None

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class ListenerHealth:
    """What the control listener's answers say besides their own request, each change logged once:
    the last failure (None once a request succeeds again) and the table's free bytes (LuaStats)."""

    def __init__(self, stats: LuaStats) -> None:
        self._stats = stats
        self.problem: str | None = None
        self._low_on_room = False

    def note_room(self, answer: Mapping[str, Any]) -> None:
        capacity, free = answer.get("bytes_capacity"), answer.get("bytes_free")
        if not isinstance(capacity, int) or not isinstance(free, int) or capacity <= 0:
            return
        self._stats.bytes_capacity, self._stats.bytes_free = capacity, free
        low = free < capacity * FREE_WARNING_SHARE
        if low and not self._low_on_room:
            log.warning("nginx table almost full", extra={"bytes_free": free, "bytes_capacity": capacity})
        self._low_on_room = low

    def note_problem(self, reason: str | None) -> None:
        if reason is not None and self.problem is None:
            log.warning("nginx control listener unavailable", extra={"error": reason})
        elif reason is None and self.problem is not None:
            log.info("nginx control listener answering again")
        self.problem = reason


class LuaTransport(TransportDefaults):
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
        self._control = ControlClient(
            options.nginx_control_url.rstrip("/"), options.nginx_secret_file, request_timeout=request_timeout
        )
        self._resolve = resolve
        self._poll_interval = poll_interval
        self._clock = clock
        self._lock = asyncio.Lock()
        self._table = ConfirmedTable()
        self._names = NameCache(resolve_interval)
        self.stats = LuaStats()
        self._health = ListenerHealth(self.stats)
        self.request_counter = LuaRequestCounts(self, instance=urllib.parse.urlsplit(self._control.url).netloc)

    # -- Transport protocol --

    async def read(self) -> dict[MapKey, Route]:
        """What NGINX serves. Until NGINX has answered once, this waits for it (the sidecar may
        start first), retrying with backoff; after that, a failure is Unavailable."""
        retry = FIRST_ANSWER_RETRY
        while True:
            async with self._lock:
                try:
                    if self._table.boot is None or not await self._unchanged():
                        await self._sync()
                    return await self._routes()
                except Unavailable as exc:
                    if self._table.entries_boot is not None:
                        raise
                    self._health.note_problem(str(exc))
            await asyncio.sleep(retry)
            retry = min(RETRY_CAP, retry * 2)

    async def write(self, parts: Mapping[MapKey, LuaPart], changes: Mapping[MapKey, LuaPart | None]) -> WriteResult:
        async with self._lock:
            if self._table.boot is None:
                try:
                    await self._sync()
                except Unavailable as exc:
                    if self._table.entries_boot is None:
                        raise NotConnected(f"nginx control listener has not answered yet: {exc}") from exc
                    raise
            rejected = await self._resolve_names(changes, force=frozenset())
            accepted = {key: part for key, part in changes.items() if key not in rejected} if rejected else changes
            batch = self._table.changes(accepted, self._entry_text)
            if batch is not None:
                await self._push(batch)
            return WriteResult(rejected=rejected)

    def unready(self) -> str | None:
        """Only until NGINX first confirmed its table: after that, a control listener that does
        not answer is not a reason to be unready (NGINX keeps serving its table), and the loop's
        own window of three resync intervals without a confirmed pass decides."""
        if self._table.entries_boot is not None:
            return None
        waiting = "the NGINX control listener has not answered yet"
        problem = self._health.problem
        return f"{waiting}: {problem}" if problem else waiting

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
                self._health.note_problem(str(exc))
                # An NGINX that does not answer, or refuses the restore, is asked less often.
                delay = min(max(RETRY_CAP, self._poll_interval), delay * 2)
            await asyncio.sleep(delay)

    async def aclose(self) -> None:
        await self._control.aclose()

    # -- For the request counter (adapters.nginx.counts), without the lock --

    def confirmed_maps(self) -> list[MapKey]:
        return list(self._table.parts)

    def confirmed_clusters(self, key: MapKey) -> list[str] | None:
        # The maps as they are now (a restore replaces the dict). A list: a tuple made from a
        # generator leaves more objects for the collector per page (test_nginx_lua_counts).
        part = self._table.parts.get(key)
        return None if part is None else [backend.cluster for backend in part.backends]

    async def exchange(self, method: str, path: str, body: str | None = None) -> tuple[int, dict[str, Any], str]:
        """One control request (ControlClient.exchange)."""
        return await self._control.exchange(method, path, body)

    # -- Internals (called with the lock held) --

    async def _request(self, method: str, path: str, body: str | None = None) -> tuple[dict[str, Any], str]:
        """The answer's first line (a JSON object) and the rest of it."""
        status, answer, rest = await self.exchange(method, path, body)
        self._health.note_room(answer)
        if status == 401:
            self._control.forget_secret()
            self.stats.failures["unauthorized"] += 1
            raise Unavailable("nginx control listener refused the shared secret")
        if status != 200:
            raise _Refused(status, answer)
        self._health.note_problem(None)
        return answer, rest

    async def _sync(self) -> None:
        """Make the confirmed table what NGINX holds: restore it after a restart, else adopt what it serves."""
        answer, lines = await self._request("GET", "/table")
        boot = str(answer.get("boot"))
        if self._table.boot is not None and boot != self._table.boot:
            await self._restore(boot)
            return
        try:
            read = read_table(lines)
        except ValueError as exc:
            raise Unavailable(f"nginx control listener: the table does not read back: {exc!r}") from exc
        self._names.seed(read.addresses, self._clock())
        if not read.matches(answer.get("checksum")):
            await self._repair(boot, read)
            return
        self._table.adopt(boot, int(answer.get("version", 0)), read)

    async def _repair(self, boot: str, read: TableRead) -> None:
        """The table does not match its own checksum (a batch NGINX could not undo, a hand edit):
        replace it whole (ConfirmedTable.repair), so its checksum, hostnames and entries agree again."""
        batch = self._table.repair(boot, read)
        log.warning("nginx table does not match its checksum: replacing it whole", extra={"boot": boot, "maps": len(batch.sets)})
        await self._push(batch)
        log.info("nginx table repaired", extra={"boot": boot, "maps": len(batch.sets)})

    async def _routes(self) -> dict[MapKey, Route]:
        """The table's routes, a slice at a time: 10,000 held the event loop 20-45 ms in one turn
        at every resync. Called under the lock: no write changes the table meanwhile."""
        routes: dict[MapKey, Route] = {}
        for count, (key, part) in enumerate(list(self._table.parts.items()), 1):
            routes[key] = part.route()
            if count % READ_SLICE == 0:
                await asyncio.sleep(0)
        return routes

    async def _unchanged(self) -> bool:
        """Whether NGINX holds exactly what it confirmed to us (boot, version, checksum), asked of
        /changes: a resync's read-back of 10,000 unchanged maps is then one small answer, not the
        whole table parsed on the event loop (0.6 s)."""
        try:
            answer, changes = await self._request("GET", f"/changes?boot={self._table.boot}&since={self._table.version}")
        except _Refused:
            return False  # 410: another boot, or the change log no longer reaches our version
        return self._table.holds(answer) and not changes.strip()

    async def _check_boot(self) -> None:
        answer, _ = await self._request("GET", "/state")
        boot = str(answer.get("boot"))
        if self._table.boot is None:
            return
        if boot != self._table.boot:
            await self._restore(boot)
        elif answer.get("checksum") != self._table.checksum:
            # Someone else wrote the table: adopt what it holds; the engine's resync repairs it.
            log.warning("nginx table changed outside the sidecar", extra={"boot": boot})
            self._table.forget_boot()
            await self._sync()

    async def _restore(self, boot: str) -> None:
        """NGINX restarted (a new boot id, an empty table): push the whole confirmed table. Until
        NGINX confirms it, the table stays ours to restore."""
        self.stats.restarts_detected += 1
        maps = len(self._table.entries)
        log.warning("nginx restart detected", extra={"boot": boot, "previous_boot": self._table.boot, "maps": maps})
        await self._push(self._table.restore(boot))
        log.info("nginx table restored", extra={"boot": boot, "maps": len(self._table.entries)})

    async def _push(self, batch: Batch) -> None:
        """One batch; returns once NGINX confirmed it by boot id, version and checksum."""
        try:
            answer, _ = await self._request("POST", "/batch", batch.body())
        except _Refused as refused:
            if refused.status == 409 and not batch.replace:
                # A restart between our last look and this batch: restore, then apply the batch.
                await self._restore(str(refused.body.get("boot")))
                return await self._push(self._table.batch(batch.sets, batch.parts, batch.deletes))
            reason = {400: "invalid", 507: "table_full"}.get(refused.status, f"http_{refused.status}")
            self.stats.failures[reason] += 1
            log.warning("nginx refused batch", extra={"reason": reason, "maps": batch.maps, "error": str(refused)})
            if batch.replace:
                # A whole table the engine confirmed, refused (a restart with a smaller dict): no
                # map is to blame, and splitting it would only refuse each map in turn.
                raise Unavailable(f"nginx refused the whole confirmed table: {refused}") from None
            if refused.status in (400, 507):
                raise Rejected(f"nginx refused the batch: {refused}") from None
            # What NGINX holds is unknown (a 500: a batch it could not undo): read it whole.
            self._table.forget_boot()
            raise Unavailable(f"nginx control listener: {refused}") from None
        except Unavailable:
            self.stats.failures["unreachable"] += 1
            raise
        if not self._table.confirm(batch, answer):
            self.stats.failures["unconfirmed"] += 1
            # The table forgot its boot: the next call reads NGINX's back.
            raise Unavailable(f"nginx did not confirm the batch (answered {answer!r})")
        self.stats.pushes += 1

    def _entry_text(self, part: LuaPart) -> str:
        return entry_text(part, {b.name: self._names.addresses(b.name) for b in part.backends})

    async def _resolve_names(self, changes: Mapping[MapKey, LuaPart | None], *, force: frozenset[str]) -> dict[MapKey, str]:
        """Resolve, concurrently, every name of `changes` not known or due (or in `force`); the
        maps whose names do not resolve, with why (NameCache: fail static)."""
        now = self._clock()
        due = self._names.due(changes.values(), now, force=force)
        lookups = (asyncio.wait_for(self._resolve(name, port), RESOLVE_TIMEOUT) for name, port in due)
        failed = self._names.settle(due, await asyncio.gather(*lookups, return_exceptions=True), now)
        if failed:
            self.stats.failures["resolve"] += len(failed)
        return rejected_maps(changes, failed)

    async def _refresh_names(self) -> None:
        """Re-resolve the names that are due; push the maps whose addresses moved."""
        if self._table.boot is None:
            return
        now = self._clock()
        due = self._names.stale(now)
        if not due:
            return
        affected = self._table.using(due)
        await self._resolve_names(affected, force=due)
        self._names.refreshed(due, now)
        batch = self._table.changes(affected, self._entry_text)
        if batch is not None:
            log.info("nginx endpoint addresses moved", extra={"maps": len(batch.sets)})
            await self._push(batch)
        self._names.forget(due - {b.name for part in affected.values() for b in part.backends})


def build(options: NginxOptions) -> tuple[LuaRenderer, LuaTransport]:
    """Lua mode's renderer and transport, for adapters.engine.Engine."""
    return LuaRenderer(rewrite_host=options.rewrite_host), LuaTransport(options)
