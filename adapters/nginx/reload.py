"""The NGINX OSS adapter in reload mode: the transport that owns one file (its pure renderer is
adapters.nginx.reload_render).

The transport assembles every part into the one file it owns (included inside `http {}`), writes
it atomically, validates it (`--nginx-test-cmd`), reloads (SIGHUP through `--nginx-pid-file`, or
`--nginx-reload-cmd`) at most once per `--nginx-min-reload-interval`, confirms by the version the
status listener serves, and on a refusal puts back the file it last confirmed. It keeps a copy of
that file beside it (`.NAME.confirmed`), so a restarted sidecar can prove what NGINX serves; it
touches no other file. Deciding which map goes in, hostname ownership and isolating a refused map
are the engine's.

The main nginx.conf must leave room for what this file adds: raise `server_names_hash_max_size`,
`server_names_hash_bucket_size` (and, with --rewrite-host, `variables_hash_max_size` and
`map_hash_max_size`) for thousands of maps, and declare no other `default_server` on --nginx-listen.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import shlex
import signal
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Protocol

import aiohttp

from adapters.base import Rejected, Unavailable, WriteResult, in_words, write_atomic
from adapters.nginx.options import NginxOptions
from adapters.nginx.reload_render import ROUTE_PREFIX, NginxPart, NginxRenderer, assemble, read_back, version_of
from publisher.core.values import MapKey, Route

# The name it had before the move into adapters/nginx/: log filters keep working.
log = logging.getLogger("adapters.nginx")


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
