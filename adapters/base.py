"""The seams every gateway adapter implements, and what adapters share.

A gateway is a pure `Renderer` (what it cannot express, one map's part) plus a small `Transport`
(write parts, confirm, read back what is served, and optionally `serve()` for gateways that connect
to us). `adapters.engine.Engine` puts the two together and is the only owner of gateway state; the
loop talks to the engine through the `Adapter` interface below.

An adapter sees Publications, never TrafficMaps. It writes only what it owns, atomically or
idempotently, validates before it swaps, reads back what the gateway holds, and says what happened
in an ApplyResult. It does not log metrics or decide anything about maps.

Exceptions, for failed I/O only:

    AdapterError
    ├── Rejected      the gateway refused the whole write; the last good config is kept
    └── Unavailable   the gateway could not be reached or read; retry later
        └── NotConnected  no gateway client is connected: nothing was written; retry once one is

A refusal the adapter can pin on single maps is not an exception: it isolates those maps, publishes
the rest, and lists them in ApplyResult.rejected.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

from publisher.core.addresses import is_dns_label, is_dns_subdomain, is_hostname, parse_endpoint
from publisher.core.model import MAX_WEIGHT
from publisher.core.values import Held, MapKey, Publication, Route

PartT = TypeVar("PartT")


class AdapterError(Exception):
    """A gateway write or read failed."""


class Rejected(AdapterError):
    """The gateway refused the new configuration as a whole and kept its last good one."""


class Unavailable(AdapterError):
    """The gateway could not be reached, or did not confirm in time: retry later."""


class NotConnected(Unavailable):
    """No gateway client is connected: nothing was written and nothing was lost; retry once one is."""


def in_words(exc: BaseException) -> str:
    """A failed call as a person says it: the path or the host:port it was about, then why. Never
    the exception's repr (`ClientConnectorError(ConnectionKey(...))`, or `FileNotFoundError(2, ...)`,
    whose repr drops the path)."""
    if isinstance(exc, TimeoutError):
        return str(exc) or "no answer in time"
    if isinstance(exc, KeyError):
        return f"no {exc}"
    if isinstance(exc, OSError):
        reason = os.strerror(exc.errno) if exc.errno else exc.strerror or " ".join(str(exc).split()) or type(exc).__name__
        # aiohttp's connection errors are OSErrors that know the host and port they tried.
        host, port = getattr(exc, "host", None), getattr(exc, "port", None)
        where = exc.filename if exc.filename is not None else f"{host}:{port}" if host is not None else None
        return f"{where}: {reason}" if where is not None else reason
    return " ".join(str(exc).split()) or type(exc).__name__


@dataclass(frozen=True, slots=True)
class RequestCounts:
    """One interval of requests per map backend, counted when the gateway picked the backend, as
    one gateway instance counted them. The interval began at the instance's previous report."""

    instance: str
    counts: Mapping[MapKey, Mapping[str, int]] = field(default_factory=dict)
    # Its counting started over (a new stream or boot): all its windows restart.
    restarted: bool = False
    # The instance is gone (its stream ended): its windows are dropped.
    left: bool = False
    # Maps whose count alone started over (a counter evicted and made again): their windows restart.
    recounted: frozenset[MapKey] = frozenset()
    # When it was counted (time.monotonic()): the interval's end. None: when it is folded.
    at: float | None = None


@runtime_checkable
class RequestCounter(Protocol):
    """Optional, beside a transport (as its `request_counter`): what each gateway instance counted,
    for the served-split check. Nothing is counted until `enable`."""

    def enable(self, interval: float) -> None: ...

    async def collect(self) -> list[RequestCounts]:
        """The reports that arrived since the last call. Raises AdapterError."""
        ...


@dataclass(frozen=True)
class ApplyResult:
    """What one apply did.

    rejected: maps that were not written, with why: the gateway refused them (ApplyFailed, or the
        transport's own reason such as ClaimRejected), another map owns their hostname
        (HostConflict), or rendering raised (InternalError). The gateway keeps what it served
        for them before.
    notes: maps the gateway took, with something worth a line in their condition message.
    released: maps to decide again: waiting for a hostname that this apply freed, or whose
        confirmed route changed when the gateway was read back (it lost or changed them).
    wrote: whether anything was written at all (False when nothing changed).
    reloads: gateway reloads this apply caused.
    """

    rejected: Mapping[MapKey, Held] = field(default_factory=dict)
    notes: Mapping[MapKey, str] = field(default_factory=dict)
    released: frozenset[MapKey] = frozenset()
    wrote: bool = False
    reloads: int = 0


@dataclass(frozen=True)
class Reconciled:
    """What one reconcile did.

    repaired: maps that had drifted and whose repair the gateway confirmed.
    refused: maps a gateway client refuses, with its words: one that connected after the write,
        or the repair write itself. They are ApplyFailed and retried like a refused write.
    released: maps to decide again: their confirmed route changed when the gateway was read back.
    """

    repaired: frozenset[MapKey] = frozenset()
    refused: Mapping[MapKey, Held] = field(default_factory=dict)
    released: frozenset[MapKey] = frozenset()


@runtime_checkable
class Adapter(Protocol):
    """What the loop drives: `adapters.engine.Engine`, or a wrapper around one (dry run).

    `confirmed` is what the gateway serves; `apply(decided)` makes it serve each decided map's
    route (None: withdraw), writing only what differs from what it confirmed (or what a client
    refused); `reconcile()` repairs drift. One caller, one call at a time. Where the gateway
    `reads_in_pages`, a resync calls `reconcile_page` with each page of maps instead (`last`: the
    page that also reads what the gateway serves besides the adapter's maps).
    """

    name: str

    @property
    def confirmed(self) -> Mapping[MapKey, Route]: ...

    def check(self, pub: Publication) -> Held | None:
        """Pure: may `pub` reach this gateway? Held(InvalidPlan) when not."""
        ...

    async def start(self) -> Mapping[MapKey, Route]: ...

    async def apply(self, changes: Mapping[MapKey, Publication | None]) -> ApplyResult: ...

    async def reconcile(self) -> Reconciled: ...

    @property
    def reads_in_pages(self) -> bool: ...

    async def reconcile_page(self, keys: Collection[MapKey], *, last: bool) -> Reconciled: ...

    def hold_off(self) -> float: ...

    def unready(self) -> str | None: ...

    async def serve(self) -> None: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class WriteResult:
    """What one confirmed transport write did.

    rejected: maps the gateway refused that the transport could pin on them, with the gateway's
        own words (ApplyFailed) or a Held of the transport's own reason (ClaimRejected); the
        gateway keeps whatever it served for them before.
    notes: maps the gateway took, with something worth a line in their condition message.
    reloads: gateway reloads the write caused.
    held_back: maps some of the gateway's clients took and others refused (a gateway of several
        clients, such as Envoys), with the refusers' words: the write is confirmed for them (the
        clients that took them serve them), yet they are not published, and are written again
        like a refused map until every client takes them.
    """

    rejected: Mapping[MapKey, str | Held] = field(default_factory=dict)
    notes: Mapping[MapKey, str] = field(default_factory=dict)
    reloads: int = 0
    held_back: Mapping[MapKey, str] = field(default_factory=dict)


class Renderer(Protocol[PartT]):
    """Pure: how one gateway expresses one map. No I/O, no logging, no state."""

    def problem(self, key: MapKey, route: Route) -> str | None:
        """What this gateway cannot express about `route` (beyond the shared strict checks), or
        None. A problem holds the map as InvalidPlan."""
        ...

    def render(self, key: MapKey, route: Route) -> PartT:
        """The map's part of the gateway's configuration: a value the transport writes, and that
        compares equal exactly when the gateway would serve the same thing."""
        ...


class Transport(Protocol[PartT]):
    """The I/O of one gateway, driven only by the engine, one call at a time.

    `write(parts, changes)`: make the gateway serve `parts`, every map's part after this write;
    `changes` is what differs from the last confirmed state (None: remove that map), so an
    incremental gateway writes only those and a whole-file one assembles `parts`. It returns once
    the gateway confirmed. It raises `Rejected` when the gateway refused the write and still serves
    what it served before, `Unavailable` when the gateway could not be reached or did not confirm
    (what it serves is then unknown, and the engine reads it back before the next write).

    `read()`: what the gateway serves now. It never returns state the gateway does not serve (a
    file written but not confirmed, a table that a restart emptied); it raises `Unavailable` when
    it cannot tell.

    `write` and `read` raise `NotConnected` when no gateway client is there to take them (no Envoy,
    no NGINX control listener): nothing was written, and the engine retries later.

    `refusals()`: the maps a client refused outside a write since the last call (an Envoy that
    connected later and refused a map it was sent), each with the client's words; the call drains
    them. A refusal that a later write of the same map superseded is not reported.

    Hostnames are unique: the engine decides which map owns each one and never hands a transport
    two parts with one hostname, so a transport may assume it (its own check is a guard only).

    A transport whose writes reload the gateway says so with a class attribute `reloads_gateway =
    True`: only then does the sidecar export `reloads_total`.
    """

    async def read(self) -> dict[MapKey, Route]: ...

    async def write(self, parts: Mapping[MapKey, PartT], changes: Mapping[MapKey, PartT | None]) -> WriteResult: ...

    def hold_off(self) -> float:
        """Seconds the next write would have to wait (0: now), so one write carries everything
        that changed meanwhile (NGINX reloads are rate-limited this way)."""
        ...

    def unready(self) -> str | None:
        """Why the gateway cannot be written now (for example, no Envoy is connected), or None."""
        ...

    async def serve(self) -> None:
        """The transport's long-running part (the xDS server), run by the loop until cancelled;
        returns at once for a transport that has none."""
        ...

    def refusals(self) -> Mapping[MapKey, str]:
        """The maps a client refused outside a write since the last call, with its words; drains them."""
        ...

    async def aclose(self) -> None: ...


@runtime_checkable
class PagedRead(Protocol):
    """A transport that can read back part of what it serves (a file per map): a resync reads the
    gateway one page of maps at a time, fresh changes applied between pages, instead of holding
    the applier for a read of every map.

    `read_page(keys)`: what the gateway serves of `keys` (a key it does not serve is absent).
    `read_others(known)`: what it serves besides `known`, the maps the engine holds (what a hand,
    or another writer, put there).
    """

    async def read_page(self, keys: Collection[MapKey]) -> dict[MapKey, Route]: ...

    async def read_others(self, known: Collection[MapKey]) -> dict[MapKey, Route]: ...


class TransportDefaults:
    """What a transport that never waits, is always writable, runs nothing of its own and holds
    nothing to close does for the rest of the Transport protocol; a transport overrides the rest."""

    def hold_off(self) -> float:
        return 0.0

    def unready(self) -> str | None:
        return None

    async def serve(self) -> None:
        return None

    def refusals(self) -> Mapping[MapKey, str]:
        return {}

    async def aclose(self) -> None:
        return None


def duplicate_hostname(parts: Mapping[MapKey, Any], what: str) -> str | None:
    """A message naming two maps whose parts (anything with a `.hostname`) claim one hostname, or
    None: a guard of whole-file gateways, whose file would otherwise serve only one of them. It
    decides nothing: the engine owns hostnames and never writes two maps on one."""
    owners: dict[str, MapKey] = {}
    for key in sorted(parts):
        owner = owners.setdefault(parts[key].hostname, key)
        if owner != key:
            return f"maps {owner} and {key} both claim {what} {parts[key].hostname}"
    return None


# Envoy refuses a route whose weighted_clusters weights sum past a uint32 (file and xDS mode alike).
ENVOY_MAX_WEIGHT_SUM = 2**32 - 1


def envoy_weight_sum_problem(route: Route) -> str | None:
    """Why Envoy would refuse `route`'s weights on every push, or None: for both Envoy renderers'
    `problem()`, so such a map is InvalidPlan up front."""
    total = sum(backend.weight for backend in route.backends)
    if total > ENVOY_MAX_WEIGHT_SUM:
        return f"the weights sum to {total}, but Envoy takes a sum of at most {ENVOY_MAX_WEIGHT_SUM}"
    return None


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace `path` with `data` so a reader sees the old file or the new one, never a part.

    Temp file in the same directory (rename is atomic only within one filesystem), fsync of the
    file before the rename and of the directory after it, so a crash cannot leave an empty file.
    Blocking: call it through asyncio.to_thread.
    """
    directory = path.parent
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as tmp:
            tmp.write(data)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.chmod(tmp_name, mode)
        os.replace(tmp_name, path)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def publication_problem(pub: Publication) -> str | None:
    """Why `pub` must not reach any gateway's configuration, or None: every value an adapter
    writes, checked against a strict pattern. Each adapter's `check` adds what its gateway
    cannot express on top of this."""
    if not is_dns_label(pub.namespace):
        return f"namespace {pub.namespace!r} is not a DNS label"
    if not is_dns_subdomain(pub.name):
        return f"name {pub.name!r} is not a DNS-1123 subdomain"
    if not is_hostname(pub.hostname):
        return f"hostname {pub.hostname!r} is not a lower-case DNS name (optionally '*.')"
    for field_name in ("generation", "observed_isvc_generation"):
        value = getattr(pub, field_name)
        if type(value) is not int or value < 0:
            return f"{field_name} {value!r} is not a non-negative integer"
    seen: set[str] = set()
    for backend in pub.backends:
        if not is_dns_subdomain(backend.cluster):
            return f"cluster {backend.cluster!r} is not a DNS-1123 subdomain"
        if backend.cluster in seen:
            return f"cluster {backend.cluster!r} appears twice"
        seen.add(backend.cluster)
        if type(backend.weight) is not int or not 0 <= backend.weight <= MAX_WEIGHT:
            return f"backends[{backend.cluster}].weight {backend.weight!r} is outside 0..{MAX_WEIGHT}"
        try:
            parse_endpoint(backend.endpoint)
        except ValueError as exc:
            return f"backends[{backend.cluster}].endpoint: {exc}"
    return None
