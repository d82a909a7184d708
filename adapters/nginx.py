"""The NGINX OSS adapter: owns one file included inside `http {}`, reloads NGINX, confirms the reload.

Owns: rendering Publications into upstream/server blocks (pure `render`), writing that one file
atomically, validating it (`--nginx-test-cmd`), reloading (SIGHUP through `--nginx-pid-file`, or
`--nginx-reload-cmd`) at most once per `--nginx-min-reload-interval`, and confirming the reload by
reading the file's own version from the status listener. It must not touch any other NGINX file.
Every value from a Publication is checked against a strict pattern before it is written.

The main nginx.conf must leave room for what this file adds: raise `server_names_hash_max_size`,
`server_names_hash_bucket_size` (and, with --rewrite-host, `variables_hash_max_size` and
`map_hash_max_size`) for thousands of maps, and declare no other `default_server` on --nginx-listen.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import shlex
import signal
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

import aiohttp
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from adapters.base import ApplyResult, Rejected, Unavailable, publication_problem, write_atomic
from publisher.model import Held, MapKey, Publication, Reason, parse_endpoint

log = logging.getLogger(__name__)

VERSION_PATH = "/.well-known/ome-gateway-publisher/version"
PUBLICATION_PREFIX = "# ome-publication "
VERSION_PREFIX = "# version "

# split_clients takes percentages with two decimals: the whole is 10,000 hundredths of a percent.
SPLIT_UNITS = 10_000

_LISTEN = re.compile(r"^((?P<host>\*|[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]):)?(?P<port>[0-9]{1,5})$")


# --- Options ------------------------------------------------------------------------------------


def _check_listen(value: str) -> str:
    match = _LISTEN.fullmatch(value)
    if match is None or not 0 < int(match["port"]) < 65536:
        raise ValueError(f"{value!r} is not an NGINX listen address (PORT or HOST:PORT)")
    return value


_ListenAddress = Annotated[str, AfterValidator(_check_listen)]


class NginxOptions(BaseModel):
    """How the NGINX adapter reaches its NGINX. Lua mode: nginx_secret_file (and nginx_control_url).
    Reload mode: nginx_conf_file and exactly one of nginx_pid_file, nginx_reload_cmd."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    nginx_mode: Literal["lua", "reload"] = Field(
        default="lua",
        description="lua: weights pushed into the running NGINX, no reloads; reload: rewrite a file and reload. "
        "Unset, it is reload when --nginx-conf-file is given (the sidecar cannot see NGINX's modules), else lua.",
    )
    nginx_control_url: str = Field(
        default="http://127.0.0.1:8082",
        pattern=r"^https?://[A-Za-z0-9.:\[\]-]+(:[0-9]{1,5})?/?$",
        description="Lua mode: the control listener `ome-publisher nginx-config` declares; loopback, inside the pod.",
    )
    nginx_secret_file: Path | None = Field(
        default=None, description="Lua mode: the shared secret the control listener requires, read by both sides."
    )
    nginx_conf_file: Path | None = Field(
        default=None,
        description="Reload mode: the one file the adapter owns, included inside http {}; no default: it is deployment-specific.",
    )
    nginx_listen: _ListenAddress = Field(
        default="8080", description="Where published hostnames are served; 8080 needs no root, like OME's examples."
    )
    nginx_pid_file: Path | None = Field(
        default=None, description="SIGHUP the master named here; for a sidecar sharing the process namespace."
    )
    nginx_reload_cmd: str | None = Field(
        default=None, description="Run (no shell) to reload when no PID file is shared, e.g. `nginx -s reload`."
    )
    nginx_test_cmd: str | None = Field(
        default=None, description="Run (no shell) to validate before reloading; unset, a bad map is caught only after."
    )
    nginx_status_listen: _ListenAddress = Field(
        default="127.0.0.1:8081", description="Serves the file's version; loopback, as only the sidecar reads it."
    )
    nginx_min_reload_interval: float = Field(
        default=2.0,
        ge=0,
        description="Reloads cut streams after worker_shutdown_timeout; 2s bounds that to a few per minute at most.",
    )
    rewrite_host: bool = Field(
        default=False, description="Off: the client's Host passes through, as OME's own publisher does."
    )

    @model_validator(mode="before")
    @classmethod
    def _mode_from_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("nginx_mode") is None:
            data = {**data, "nginx_mode": "reload" if data.get("nginx_conf_file") is not None else "lua"}
        return data

    @model_validator(mode="after")
    def _one_reload_way(self) -> NginxOptions:
        if self.nginx_mode == "lua":
            if self.nginx_secret_file is None:
                raise ValueError("nginx_mode lua needs nginx_secret_file")
            return self
        if self.nginx_conf_file is None:
            raise ValueError("nginx_mode reload needs nginx_conf_file")
        if (self.nginx_pid_file is None) == (self.nginx_reload_cmd is None):
            raise ValueError("set exactly one of nginx_pid_file and nginx_reload_cmd")
        if self.nginx_listen == self.nginx_status_listen:
            raise ValueError("nginx_listen and nginx_status_listen must differ")
        return self

    @property
    def status_url(self) -> str:
        match = _LISTEN.fullmatch(self.nginx_status_listen)
        assert match is not None  # validated above
        host = match["host"] or "127.0.0.1"
        host = {"*": "127.0.0.1", "0.0.0.0": "127.0.0.1", "[::]": "[::1]"}.get(host, host)
        return f"http://{host}:{match['port']}{VERSION_PATH}"


# --- Pure rendering ------------------------------------------------------------------------------


def problem(pub: Publication, *, rewrite_host: bool = False) -> str | None:
    """Why `pub` cannot be written into an NGINX config, or None. Every written value passes here."""
    common = publication_problem(pub)
    if common is not None:
        return common
    schemes: set[str] = set()
    for backend in pub.backends:
        endpoint = parse_endpoint(backend.endpoint)
        if endpoint.path not in ("", "/"):
            return f"backends[{backend.cluster}].endpoint has path {endpoint.path!r}; NGINX proxies to the root only"
        schemes.add(endpoint.scheme)
    if len(schemes) > 1 and not rewrite_host:
        return "backends mix http and https endpoints; one NGINX upstream has one scheme (use --rewrite-host)"
    return None


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


def _upstream_name(pub: Publication, index: int | None = None) -> str:
    # Namespaces and names hold no "_", so "_" separates them unambiguously.
    base = f"ome_{pub.namespace}_{pub.name}"
    return base if index is None else f"{base}_{index}"


def _variable_stem(pub: Publication) -> str:
    # NGINX variable names take no "." or "-": a digest of the key stands in for it.
    return "ome_" + hashlib.sha256(f"{pub.namespace}/{pub.name}".encode()).hexdigest()[:16]


def _server_line(backend_endpoint: str, weight: int) -> str:
    endpoint = parse_endpoint(backend_endpoint)
    return f"    server {endpoint.host}:{endpoint.port} {f'weight={weight}' if weight else 'down'};\n"


_PROXY_COMMON = (
    "        proxy_http_version 1.1;\n"
    '        proxy_set_header Connection "";\n'
    "        proxy_buffering off;\n"
)


def render_part(pub: Publication, *, listen: str, rewrite_host: bool = False) -> str:
    """The config text of one Publication: its read-back line, upstream(s) and server block.

    Raises ValueError for a Publication `problem()` refuses: nothing unchecked reaches the file.
    """
    reason = problem(pub, rewrite_host=rewrite_host)
    if reason is not None:
        raise ValueError(f"{pub.key}: {reason}")
    out = [PUBLICATION_PREFIX, json.dumps(pub.to_json(), separators=(",", ":"), sort_keys=True), "\n"]
    server_head = f"server {{\n    listen {listen};\n    server_name {pub.hostname};\n    location / {{\n"
    if pub.all_zero:
        out += [server_head, "        return 503;\n    }\n}\n"]
        return "".join(out)
    if not rewrite_host:
        name = _upstream_name(pub)
        out.append(f"upstream {name} {{\n")
        out += [_server_line(b.endpoint, b.weight) for b in pub.backends]
        out.append("}\n")
        scheme = parse_endpoint(pub.backends[0].endpoint).scheme
        out += [server_head, f"        proxy_pass {scheme}://{name};\n", "        proxy_set_header Host $host;\n"]
        if scheme == "https":
            out.append("        proxy_ssl_server_name on;\n        proxy_ssl_name $host;\n")
        out += [_PROXY_COMMON, "    }\n}\n"]
        return "".join(out)
    stem = _variable_stem(pub)
    units = split_units(b.weight for b in pub.backends)
    targets, hosts, splits = [], [], []
    for index, (backend, unit) in enumerate(zip(pub.backends, units)):
        endpoint = parse_endpoint(backend.endpoint)
        name = _upstream_name(pub, index)
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
        _PROXY_COMMON,
        "    }\n}\n",
    ]
    return "".join(out)


def assemble(parts: Mapping[MapKey, str], *, listen: str, status_listen: str) -> tuple[str, str]:
    """The whole file from rendered parts, and its version (a digest of the content, so an unchanged
    file keeps its version across restarts)."""
    _check_listen(listen)
    _check_listen(status_listen)
    body = [
        "# Requests for hostnames no map publishes reach no backend.\n",
        f"server {{\n    listen {listen} default_server;\n    server_name _;\n    return 404;\n}}\n",
    ]
    body += [parts[key] for key in sorted(parts)]
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
    pubs: Iterable[Publication], *, listen: str = "8080", status_listen: str = "127.0.0.1:8081", rewrite_host: bool = False
) -> str:
    """The whole file for `pubs`. Raises ValueError for a Publication `problem()` refuses."""
    parts = {pub.key: render_part(pub, listen=listen, rewrite_host=rewrite_host) for pub in pubs}
    return assemble(parts, listen=listen, status_listen=status_listen)[0]


def read_back(text: str) -> tuple[dict[MapKey, Publication], list[str]]:
    """The Publications a file holds, and one message per line that is not a valid one."""
    pubs: dict[MapKey, Publication] = {}
    problems: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.startswith(PUBLICATION_PREFIX):
            continue
        try:
            pub = Publication.from_json(json.loads(line[len(PUBLICATION_PREFIX) :]))
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            problems.append(f"line {number}: {exc}")
            continue
        reason = problem(pub, rewrite_host=True)
        if reason is not None:
            problems.append(f"line {number}: {reason}")
            continue
        pubs[pub.key] = pub
    return pubs, problems


def version_of(text: str) -> str | None:
    for line in text.splitlines()[:5]:
        if line.startswith(VERSION_PREFIX):
            return line[len(VERSION_PREFIX) :].strip()
    return None


# --- The process side -----------------------------------------------------------------------------


class _Gateway(Protocol):
    """What the adapter asks of the running NGINX; unit tests put a fake in its place."""

    async def test(self) -> str | None:
        """None when the written config is valid, else NGINX's own error line."""
        ...

    async def reload(self) -> str | None:
        """Ask NGINX to reload; NGINX's error line when it visibly refused, else None."""
        ...

    async def served_version(self) -> str | None:
        """The version the status listener answers now, or None when it does not answer."""
        ...

    async def aclose(self) -> None: ...


@contextlib.contextmanager
def _translated(doing: str) -> Iterator[None]:
    """The one place where NGINX I/O errors become adapter errors."""
    try:
        yield
    except (OSError, TimeoutError, aiohttp.ClientError) as exc:
        raise Unavailable(f"nginx: {doing}: {exc!r}") from exc


def _error_line(output: bytes) -> str:
    lines = [line.strip() for line in output.decode(errors="replace").splitlines() if line.strip()]
    for line in lines:
        if "[emerg]" in line or "[error]" in line or "[crit]" in line:
            return line[line.index("[") :] if re.match(r"^\d{4}/", line) else line
    return lines[-1] if lines else "no output"


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
        return None if code == 0 else _error_line(output)

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
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
        try:
            async with self._session.get(self._options.status_url) as response:
                return (await response.text()).strip() if response.status == 200 else None
        except (aiohttp.ClientError, TimeoutError):
            return None

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


# --- The adapter -----------------------------------------------------------------------------------


class NginxAdapter:
    """Publishes into NGINX through one owned file; see the module docstring."""

    name = "nginx"

    def __init__(
        self,
        options: NginxOptions,
        *,
        gateway: _Gateway | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        confirm_timeout: float = 10.0,
        poll_interval: float = 0.05,
    ) -> None:
        self._options = options
        self._gateway: _Gateway = gateway if gateway is not None else _NginxProcess(options)
        self._clock = clock
        self._sleep = sleep
        self._confirm_timeout = confirm_timeout
        self._poll_interval = poll_interval
        self._good: dict[MapKey, Publication] = {}
        self._good_parts: dict[MapKey, str] = {}
        self._good_text: str | None = None  # confirmed served (or found on disk at start)
        self._disk_text: str | None = None
        self._last_reload: float | None = None

    def check(self, pub: Publication) -> Held | None:
        reason = problem(pub, rewrite_host=self._options.rewrite_host)
        return None if reason is None else Held(Reason.INVALID_PLAN, f"nginx: {reason}")

    def _part(self, pub: Publication) -> str:
        return render_part(pub, listen=self._options.nginx_listen, rewrite_host=self._options.rewrite_host)

    def _assemble(self, parts: Mapping[MapKey, str]) -> tuple[str, str]:
        return assemble(parts, listen=self._options.nginx_listen, status_listen=self._options.nginx_status_listen)

    async def current(self) -> dict[MapKey, Publication]:
        path = self._options.nginx_conf_file
        with _translated(f"read {path}"):
            try:
                text: str | None = await asyncio.to_thread(path.read_text)
            except FileNotFoundError:
                text = None
        if text is None:
            pubs: dict[MapKey, Publication] = {}
            parts: dict[MapKey, str] = {}
            text, _ = self._assemble(parts)
            await self._write(text)
            log.info("nginx file created", extra={"path": str(path)})
        else:
            pubs, problems = await asyncio.to_thread(read_back, text)
            for message in problems:
                log.warning("nginx file line ignored", extra={"path": str(path), "problem": message})
            pubs = {key: pub for key, pub in pubs.items() if self.check(pub) is None}
            parts = await asyncio.to_thread(lambda: {key: self._part(pub) for key, pub in pubs.items()})
            self._disk_text = text
        self._good, self._good_parts, self._good_text = pubs, parts, text
        return dict(pubs)

    async def apply(self, desired: Mapping[MapKey, Publication], changed: frozenset[MapKey]) -> ApplyResult:
        if self._good_text is None:
            await self.current()
        rejected: dict[MapKey, Held] = {}
        base_parts = dict(self._good_parts)
        base_pubs = dict(self._good)
        attempted: dict[MapKey, tuple[Publication, str]] = {}
        for key in changed:
            pub = desired.get(key)
            if pub is None:
                base_parts.pop(key, None)
                base_pubs.pop(key, None)
                continue
            held = self.check(pub)
            if held is not None:
                rejected[key] = held  # keeps its last good part
                continue
            attempted[key] = (pub, self._part(pub))
        parts = base_parts | {key: part for key, (_, part) in attempted.items()}
        text, version = self._assemble(parts)
        if text == self._good_text:
            if self._disk_text != text:
                await self._write(text)
            return ApplyResult(rejected=rejected)
        if self._options.nginx_test_cmd is not None:
            error = await self._test(text)
            if error is not None:
                bad = await self._isolate(base_parts, attempted, error)
                rejected |= bad
                attempted = {key: value for key, value in attempted.items() if key not in bad}
                parts = base_parts | {key: part for key, (_, part) in attempted.items()}
                text, version = self._assemble(parts)
                if text == self._good_text:
                    await self._write(text)
                    return ApplyResult(rejected=rejected, wrote=True)
                await self._write(text)
        else:
            await self._write(text)
        error, reloads = await self._reload_and_confirm(version)
        if error is not None:
            reloads += await self._restore(reloaded=reloads > 0)
            message = f"nginx did not take the new configuration ({error}); restored the last good one"
            for key in changed:
                rejected.setdefault(key, Held(Reason.APPLY_FAILED, message))
            log.warning("nginx reload failed", extra={"version": version, "maps": len(changed), "error": error})
            return ApplyResult(rejected=rejected, wrote=True, reloads=reloads)
        self._good = base_pubs | {key: pub for key, (pub, _) in attempted.items()}
        self._good_parts = parts
        self._good_text = text
        log.info("nginx reloaded", extra={"version": version, "maps": len(parts), "changed": len(changed)})
        return ApplyResult(rejected=rejected, wrote=True, reloads=reloads)

    async def aclose(self) -> None:
        await self._gateway.aclose()

    async def _write(self, text: str) -> None:
        with _translated(f"write {self._options.nginx_conf_file}"):
            await asyncio.to_thread(write_atomic, self._options.nginx_conf_file, text.encode())
        self._disk_text = text

    async def _test(self, text: str) -> str | None:
        if self._disk_text != text:
            await self._write(text)
        with _translated("test the configuration"):
            return await self._gateway.test()

    async def _isolate(
        self, base: dict[MapKey, str], attempted: dict[MapKey, tuple[Publication, str]], error: str
    ) -> dict[MapKey, Held]:
        """Find the changed maps NGINX refuses by bisection on top of the last good set (minus removals)."""
        base_error = await self._test(self._assemble(base)[0])
        if base_error is not None or not attempted:
            await self._write(self._good_text or "")
            raise Rejected(f"nginx refuses the configuration without this change: {base_error or error}")
        accepted = dict(base)
        bad: dict[MapKey, Held] = {}

        async def bisect(keys: list[MapKey], known_error: str | None) -> None:
            error = known_error
            if error is None:
                error = await self._test(self._assemble(accepted | {k: attempted[k][1] for k in keys})[0])
                if error is None:
                    accepted.update((k, attempted[k][1]) for k in keys)
                    return
            if len(keys) == 1:
                bad[keys[0]] = Held(Reason.APPLY_FAILED, f"nginx refused this map: {error}")
                return
            middle = len(keys) // 2
            await bisect(keys[:middle], None)
            await bisect(keys[middle:], None)

        await bisect(sorted(attempted), error)
        for key, held in bad.items():
            log.warning("nginx refused map", extra={"map": str(key), "error": held.message})
        return bad

    def hold_off(self) -> float:
        """Seconds until the next reload is allowed. The loop waits this out before it takes its
        next batch, so one reload carries every change made while it waited."""
        if self._last_reload is None:
            return 0.0
        return max(0.0, self._last_reload + self._options.nginx_min_reload_interval - self._clock())

    async def _wait_for_interval(self) -> None:
        # Still enforced here: a caller that ignores hold_off() must not reload more often.
        wait = self.hold_off()
        if wait > 0:
            await self._sleep(wait)

    async def _reload_and_confirm(self, version: str) -> tuple[str | None, int]:
        """Reload (no sooner than the min interval after the last) and wait until NGINX serves
        `version`: (None, reloads) when it does, else (what went wrong, reloads)."""
        await self._wait_for_interval()
        with _translated("reload"):
            refused = await self._gateway.reload()
        if refused is not None:
            return refused, 0
        self._last_reload = self._clock()
        deadline = self._clock() + self._confirm_timeout
        while True:
            with _translated("read the served version"):
                served = await self._gateway.served_version()
            if served == version:
                return None, 1
            if self._clock() >= deadline:
                return f"still serving version {served} {self._confirm_timeout}s after the reload", 1
            await self._sleep(self._poll_interval)

    async def _restore(self, *, reloaded: bool) -> int:
        """Put the last good file back, and reload it if NGINX was reloaded; the reloads this took."""
        assert self._good_text is not None
        await self._write(self._good_text)
        if not reloaded:
            return 0
        good_version = version_of(self._good_text) or ""
        error, reloads = await self._reload_and_confirm(good_version)
        if error is not None:
            raise Unavailable(f"nginx serves neither the new configuration nor the last good one: {error}")
        return reloads


def build(options: NginxOptions) -> tuple[Any, Any]:
    """The renderer and transport for options.nginx_mode: Lua mode lives in adapters.nginx_lua;
    reload mode is this module's NginxAdapter through the engine's bridge for whole adapters."""
    if options.nginx_mode == "lua":
        from adapters.nginx_lua import build as build_lua

        return build_lua(options)
    from adapters._legacy import build_legacy

    return build_legacy(NginxAdapter, options)
