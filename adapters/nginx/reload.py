"""The NGINX OSS adapter in reload mode: a pure renderer, and a transport that owns one file.

The renderer turns one map's Route into its upstream/server blocks and a read-back line (no
generation: a generation-only change renders the same text). The transport assembles every part
into the one file it owns (included inside `http {}`), writes it atomically, validates it
(`--nginx-test-cmd`), reloads (SIGHUP through `--nginx-pid-file`, or `--nginx-reload-cmd`) at most
once per `--nginx-min-reload-interval`, confirms by the version the status listener serves, and on
a refusal puts back the file it last confirmed. It keeps a copy of that file beside it
(`.NAME.confirmed`), so a restarted sidecar can prove what NGINX serves; it touches no other file.
Deciding which map goes in, hostname ownership and isolating a refused map are the engine's.

The main nginx.conf must leave room for what this file adds: raise `server_names_hash_max_size`,
`server_names_hash_bucket_size` (and, with --rewrite-host, `variables_hash_max_size` and
`map_hash_max_size`) for thousands of maps, and declare no other `default_server` on --nginx-listen.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import shlex
import signal
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import aiohttp

from adapters.base import Rejected, Unavailable, WriteResult, duplicate_hostname, in_words, publication_problem, write_atomic
from adapters.listen import check_nginx_listen
from adapters.nginx.options import VERSION_PATH, NginxOptions
from adapters.route_json import from_json as route_from_json
from adapters.route_json import to_json as route_json
from adapters.timeouts import DEFAULT_ROUTE_IDLE_TIMEOUT, unit_duration
from publisher.core.addresses import parse_endpoint
from publisher.core.values import MapKey, Publication, Route

# The name it had before the move into adapters/nginx/: log filters keep working.
log = logging.getLogger("adapters.nginx")

ROUTE_PREFIX = "# ome-route "
# Files written before routes left provenance out carry the whole Publication; still read back.
LEGACY_PREFIX = "# ome-publication "
VERSION_PREFIX = "# version "

# split_clients takes percentages with two decimals: the whole is 10,000 hundredths of a percent.
SPLIT_UNITS = 10_000


# --- Pure rendering ------------------------------------------------------------------------------


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


# --- The process side -----------------------------------------------------------------------------


class _Gateway(Protocol):
    """What the transport asks of the running NGINX; unit tests put a fake in its place."""

    async def test(self) -> str | None:
        """None when the written config is valid, else NGINX's own error (or conflict) line."""
        ...

    async def reload(self) -> str | None:
        """Ask NGINX to reload; NGINX's error line when it visibly refused, else None."""
        ...

    async def served_version(self) -> str | None:
        """The version the status listener answers now; None when nothing listens there (NGINX
        serves none of our file). Raises Unavailable when it cannot tell."""
        ...

    async def aclose(self) -> None: ...


@contextlib.contextmanager
def _translated(doing: str) -> Iterator[None]:
    """The one place where NGINX I/O errors become adapter errors."""
    try:
        yield
    except (OSError, TimeoutError, aiohttp.ClientError) as exc:
        raise Unavailable(f"nginx: {doing}: {in_words(exc)}") from exc


def _error_line(output: bytes) -> str:
    lines = [line.strip() for line in output.decode(errors="replace").splitlines() if line.strip()]
    for line in lines:
        if "[emerg]" in line or "[error]" in line or "[crit]" in line:
            return line[line.index("[") :] if re.match(r"^\d{4}/", line) else line
    return lines[-1] if lines else "no output"


def _conflict_line(output: bytes) -> str | None:
    """NGINX's warning that a server_name is served twice (one block ignored), or None. `nginx -t`
    passes with it, and `-q` hides it: only a test command without `-q` shows it."""
    for line in output.decode(errors="replace").splitlines():
        if "conflicting server name" in line:
            line = line.strip()
            return line[line.index("[") :] if re.match(r"^\d{4}/", line) else line
    return None


class _NginxProcess:
    """The real NGINX: commands without a shell, SIGHUP by PID file, version over HTTP."""

    def __init__(self, options: NginxOptions, *, command_timeout: float = 30.0) -> None:
        self._options = options
        self._command_timeout = command_timeout
        self._session: aiohttp.ClientSession | None = None

    async def _run(self, command: str) -> tuple[int, bytes]:
        argv = shlex.split(command)
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        try:
            output, _ = await asyncio.wait_for(process.communicate(), self._command_timeout)
        except BaseException:
            if process.returncode is None:
                process.kill()
                await process.wait()
            raise
        assert process.returncode is not None
        return process.returncode, output

    async def test(self) -> str | None:
        if self._options.nginx_test_cmd is None:
            return None
        code, output = await self._run(self._options.nginx_test_cmd)
        return _error_line(output) if code != 0 else _conflict_line(output)

    async def reload(self) -> str | None:
        if self._options.nginx_reload_cmd is not None:
            # `nginx -s reload` parses the configuration first and signals nothing when it fails.
            code, output = await self._run(self._options.nginx_reload_cmd)
            return None if code == 0 else _error_line(output)
        assert self._options.nginx_pid_file is not None
        text = await asyncio.to_thread(self._options.nginx_pid_file.read_text)
        try:
            pid = int(text.strip())
        except ValueError:
            raise Unavailable(f"nginx PID file {self._options.nginx_pid_file} holds {text.strip()!r}") from None
        os.kill(pid, signal.SIGHUP)
        return None

    async def served_version(self) -> str | None:
        if self._session is None:
            # A fresh connection per question: a kept-alive one may reach a worker of the old
            # configuration, or keep reaching the one new worker while old ones still accept.
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=2), connector=aiohttp.TCPConnector(force_close=True)
            )
        url = self._options.status_url
        try:
            async with self._session.get(url) as response:
                if response.status != 200:
                    raise Unavailable(f"nginx: status listener {url} answered {response.status}")
                return (await response.text()).strip()
        except aiohttp.ClientConnectorError:
            return None  # nothing listens: NGINX is not running our file
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise Unavailable(f"nginx: status listener {url}: {exc!r}") from exc

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


# --- The transport ---------------------------------------------------------------------------------


# How long every answer must name the new version before a reload counts as confirmed: old
# workers close their listeners a moment after the new ones start, longer on a loaded machine.
CONFIRMING_FOR = 0.3


class NginxFileTransport:
    """The `Transport` of reload mode: see the module docstring. The engine drives it, one call at a time."""

    # Each confirmed write is an NGINX reload (WriteResult.reloads), counted in reloads_total.
    reloads_gateway = True

    # NGINX's reload time grows with the file: 10,000 maps (40,000 upstream servers) took 18-23 s
    # per reload on a loaded 2-core machine. Past `confirm_timeout` plus this per map, a reload
    # that never showed its version counts as refused (NGINX keeps the old config when it fails).
    seconds_per_map = 0.005

    def __init__(
        self,
        options: NginxOptions,
        *,
        gateway: _Gateway | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        confirm_timeout: float = 10.0,
        poll_interval: float = 0.05,
        confirm_for: float = CONFIRMING_FOR,
    ) -> None:
        self._options = options
        assert options.nginx_conf_file is not None, "reload mode's options validate that it is set"
        self._path = options.nginx_conf_file
        self._confirmed_path = self._path.with_name(f".{self._path.name}.confirmed")
        self._gateway: _Gateway = gateway if gateway is not None else _NginxProcess(options)
        self._clock = clock
        self._sleep = sleep
        self._confirm_timeout = confirm_timeout
        self._poll_interval = poll_interval
        self._confirm_for = confirm_for
        # The file NGINX was last seen serving (confirmed by its version): the only one restored.
        self._confirmed_text: str | None = None
        self._disk_text: str | None = None
        self._last_reload: float | None = None

    def _assemble(self, parts: Mapping[MapKey, NginxPart]) -> tuple[str, str]:
        return assemble(parts, listen=self._options.nginx_listen, status_listen=self._options.nginx_status_listen)

    async def read(self) -> dict[MapKey, Route]:
        """What NGINX serves: a file's routes only when its version is the one NGINX serves (the
        file on disk, else the last confirmed one, kept beside it across restarts); nothing when
        NGINX serves none of our files or a version none holds. A file NGINX refused is never
        taken for what it serves."""
        with _translated(f"read {self._path}"):
            disk = await self._read_text(self._path)
            served = await self._gateway.served_version()
            if served is not None:
                for text in (disk, self._confirmed_text, await self._read_text(self._confirmed_path)):
                    if text is not None and version_of(text) == served:
                        if text != disk:
                            log.warning(
                                "nginx file on disk is not what nginx serves; the served one is put back",
                                extra={"path": str(self._path), "served": served, "file": disk and version_of(disk)},
                            )
                            await self._put(text)
                        self._confirmed_text = text
                        # With this sidecar's idle timeout: after it changes, every map is
                        # written again, not only the next one that changes.
                        idle_timeout = self._options.route_idle_timeout
                        routes, problems = await asyncio.to_thread(functools.partial(read_back, text, idle_timeout=idle_timeout))
                        for message in problems:
                            log.warning("nginx file line ignored", extra={"path": str(self._path), "problem": message})
                        return routes
            if disk is None:
                # NGINX cannot start while its include is missing; an empty file serves nothing.
                await self._put(self._assemble({})[0])
                log.info("nginx file created", extra={"path": str(self._path)})
        self._confirmed_text = None
        if served is not None:
            # Nothing proves what NGINX serves, so nothing is claimed: the engine then writes every
            # map it wants, which replaces the unproven file (Unavailable would block that write).
            log.warning(
                "nginx serves a version no file holds; nothing is taken as served",
                extra={"path": str(self._path), "served": served, "file": disk and version_of(disk)},
            )
        return {}

    async def write(self, parts: Mapping[MapKey, NginxPart], changes: Mapping[MapKey, NginxPart | None]) -> WriteResult:
        """Assemble `parts`, test, reload and confirm. Rejected: NGINX refused and serves the last
        confirmed file, which is back on disk. Unavailable: what NGINX serves is unknown."""
        try:
            text, version = await asyncio.to_thread(self._assemble, parts)
        except ValueError as exc:
            raise Rejected(f"nginx: {exc}") from exc
        if text == self._confirmed_text:
            if self._disk_text != text:
                await self._put(text)
            return WriteResult()
        before = self._disk_text
        await self._put(text)
        reloads = 0
        try:
            error = None
            if self._options.nginx_test_cmd is not None:
                with _translated("test the configuration"):
                    error = await self._gateway.test()
            if error is None:
                error, reloads = await self._reload_and_confirm(version, self.seconds_per_map * len(parts))
        except Unavailable:
            # Not reloaded (NGINX down, a command that would not run): the confirmed file goes
            # back; with none, the new file stays, as it is what NGINX should start from.
            if reloads == 0 and self._confirmed_text is not None:
                await self._put(self._confirmed_text)
            raise
        if error is None:
            self._confirmed_text = text
            await self._keep_confirmed_copy(text)
            log.info("nginx reloaded", extra={"version": version, "maps": len(parts), "changed": len(changes)})
            return WriteResult(reloads=reloads)
        log.warning("nginx refused a configuration", extra={"version": version, "maps": len(changes), "error": error})
        await self._restore(before, reloaded=reloads > 0)
        raise Rejected(f"nginx did not take the new configuration ({error}); it still serves the last confirmed one")

    def hold_off(self) -> float:
        """Seconds until the next reload is allowed, so one reload carries every change made meanwhile."""
        if self._last_reload is None:
            return 0.0
        return max(0.0, self._last_reload + self._options.nginx_min_reload_interval - self._clock())

    def unready(self) -> str | None:
        return None

    def refusals(self) -> Mapping[MapKey, str]:
        return {}

    async def serve(self) -> None:
        return None

    async def aclose(self) -> None:
        await self._gateway.aclose()

    async def _read_text(self, path: Path) -> str | None:
        try:
            return await asyncio.to_thread(path.read_text)
        except FileNotFoundError:
            return None

    async def _put(self, text: str) -> None:
        with _translated(f"write {self._path}"):
            await asyncio.to_thread(write_atomic, self._path, text.encode())
        self._disk_text = text

    async def _put_back(self, before: str | None) -> None:
        """The file before an attempt that never reached NGINX: the confirmed one when known."""
        text = self._confirmed_text if self._confirmed_text is not None else before
        if text is not None:
            await self._put(text)

    async def _keep_confirmed_copy(self, text: str) -> None:
        # A copy, not a hard link: an edit in place of the owned file must not change it too.
        # NGINX has confirmed already: a copy that cannot be written costs only the proof after a
        # restart, so it is a warning, not a failed write.
        try:
            await asyncio.to_thread(write_atomic, self._confirmed_path, text.encode())
        except OSError as exc:
            log.warning("nginx confirmed copy not written", extra={"path": str(self._confirmed_path), "error": in_words(exc)})

    async def _wait_for_interval(self) -> None:
        # Still enforced here: a caller that ignores hold_off() must not reload more often.
        wait = self.hold_off()
        if wait > 0:
            await self._sleep(wait)

    async def _reload_and_confirm(self, version: str, allowance: float) -> tuple[str | None, int]:
        """Reload (no sooner than the min interval after the last) and wait until NGINX serves
        `version`: (None, reloads) when it does, else (what went wrong, reloads)."""
        await self._wait_for_interval()
        with _translated("reload"):
            refused = await self._gateway.reload()
        if refused is not None:
            return refused, 0
        self._last_reload = self._clock()
        timeout = self._confirm_timeout + allowance
        deadline = self._clock() + timeout
        served: str | None = None
        agreeing_since: float | None = None
        while True:
            with contextlib.suppress(Unavailable):  # a slow answer during a reload: ask again
                served = await self._gateway.served_version()
            # Old workers keep accepting for a moment after a new one answers: only answers that
            # name `version` for a while, each on a new connection, say that every worker does.
            now = self._clock()
            agreeing_since = (agreeing_since if agreeing_since is not None else now) if served == version else None
            if agreeing_since is not None and now - agreeing_since >= self._confirm_for:
                return None, 1
            if self._clock() >= deadline:
                return f"still serving version {served} {timeout:.1f}s after the reload", 1
            await self._sleep(self._poll_interval)

    async def _restore(self, before: str | None, *, reloaded: bool) -> None:
        """Put the last confirmed file back, and reload it if NGINX was reloaded. Raises
        Unavailable when NGINX then serves neither."""
        await self._put_back(before)
        if not reloaded:
            return
        if self._confirmed_text is None:
            raise Unavailable("nginx did not confirm the new configuration, and no earlier one was confirmed")
        allowance = self.seconds_per_map * self._confirmed_text.count(ROUTE_PREFIX)
        error, _ = await self._reload_and_confirm(version_of(self._confirmed_text) or "", allowance)
        if error is not None:
            raise Unavailable(f"nginx serves neither the new configuration nor the last confirmed one: {error}")


def build_reload(options: NginxOptions) -> tuple[NginxRenderer, NginxFileTransport]:
    """Reload mode's renderer and transport for the engine."""
    renderer = NginxRenderer(listen=options.nginx_listen, rewrite_host=options.rewrite_host, idle_timeout=options.route_idle_timeout)
    return renderer, NginxFileTransport(options)
