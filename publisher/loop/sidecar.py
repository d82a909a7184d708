"""Running the loop: the sidecar's tasks (`run`), one full pass (`once`), and the HTTP server.

Owns no state: the tasks it starts are the Publisher's and its parts', and the garbage collector's
start-up threshold is set here and given back here.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from typing import Protocol

from aiohttp import web

from publisher import metrics
from publisher.kube import Kube
from publisher.loop.leader import LeaderOptions, run_leader_election
from publisher.loop.options import STARTUP_GC_OLDER, STARTUP_GC_THRESHOLD
from publisher.loop.pipeline import Publisher

log = logging.getLogger("publisher.loop")


class Source(Protocol):
    async def run(self) -> None: ...

    def problem(self) -> str | None: ...


class SyncTimeout(Exception):
    """--once or --dry-run did not get a full view of the source in time; the message says why."""


class ListenError(OSError):
    """The HTTP server cannot listen where it was told to."""



async def start_server(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Listen before anything else starts, so a port in use is one clear start-up error."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        await runner.cleanup()
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise ListenError(exc.errno, f"cannot listen on {host}:{port}: {reason}") from exc
    log.info("serving", extra={"listen": f"{host}:{port}"})
    return runner


async def serve(runner: web.AppRunner) -> None:
    """Serve until cancelled, then close the server."""
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


async def run(
    publisher: Publisher,
    source: Source,
    *,
    listen: tuple[str, int] | None = None,
    leader: LeaderOptions | None = None,
    kube: Kube | None = None,
) -> None:
    """The sidecar: one TaskGroup owns the server, the source, the applier, resync and status.
    `leader` elects the status writer by a Lease on `kube`."""
    publisher.source_problem = source.problem
    gc.set_threshold(STARTUP_GC_THRESHOLD, STARTUP_GC_OLDER, publisher.gc_threshold[2])
    try:
        runner = await start_server(metrics.make_app(publisher), *listen) if listen is not None else None
        async with asyncio.TaskGroup() as group:
            if runner is not None:
                group.create_task(serve(runner))
            group.create_task(publisher.adapter.serve())
            # The first list and the gateway's read-back (Envoy's, for one, waits for an Envoy to
            # connect) run side by side; the applier starts once both are done.
            group.create_task(source.run())
            await publisher.start()
            group.create_task(publisher.run_applier())
            group.create_task(publisher.run_resync())
            if publisher.split is not None:
                group.create_task(publisher.split.run())
            if publisher.outbox.sink is not None:
                group.create_task(publisher.outbox.run())
                if leader is not None:
                    assert kube is not None, "leader election needs the API server"
                    publisher.outbox.follow()
                    group.create_task(run_leader_election(publisher, kube, leader))
    finally:
        gc.set_threshold(*publisher.gc_threshold)  # also when stopped before the first sync


async def once(publisher: Publisher, source: Source, *, read_gateway: bool = True, timeout: float | None = None) -> None:
    """One full sync: read the gateway, take the source's first full view, wait until the gateway
    can be written (its own server, xDS, runs meanwhile), one gateway write, then every status
    write. `read_gateway=False` plans against an empty gateway (dry run).
    Raises SyncTimeout when the whole pass takes longer than `timeout`, and what the source
    raised (e.g. a refusal) when it ends before its first full view."""
    publisher.source_problem = source.problem
    try:
        async with asyncio.timeout(timeout):
            await _once(publisher, source, read_gateway=read_gateway)
    except TimeoutError:
        problem = source.problem()
        why = f": {problem}" if problem else ""
        unready = publisher.adapter.unready()
        if not publisher.started:
            waiting = publisher.gateway.waiting or unready
            stage = f"the gateway's read-back ({waiting})" if waiting else "the gateway's read-back"
        elif not publisher.is_synced:
            stage = "the source's first full view"
        else:
            stage = f"the gateway: {unready}" if unready is not None else "the gateway write and status writes"
        raise SyncTimeout(f"no result within {timeout:g}s, waiting for {stage}{why}") from None


async def _once(publisher: Publisher, source: Source, *, read_gateway: bool) -> None:
    # The gateway's own server (xDS) runs through the pass, so an Envoy can connect and confirm.
    gateway = asyncio.create_task(publisher.adapter.serve()) if read_gateway else None
    try:
        await _one_pass(publisher, source, gateway, read_gateway=read_gateway)
    finally:
        if gateway is not None:
            gateway.cancel()
            await asyncio.gather(gateway, return_exceptions=True)


async def _gateway_ready(publisher: Publisher, gateway: asyncio.Task[None]) -> None:
    """Until the gateway can be written (an Envoy connected): the one pass is written once, not
    failed for a gateway that starts after the sidecar. What the gateway's server raised (its
    address taken) ends the wait."""
    while publisher.adapter.unready() is not None:
        if gateway.done():
            gateway.result()
        await asyncio.sleep(0.05)


async def _one_pass(publisher: Publisher, source: Source, gateway: asyncio.Task[None] | None, *, read_gateway: bool) -> None:
    source_task = asyncio.create_task(source.run())
    synced = asyncio.create_task(publisher.synced_event.wait())
    try:
        if read_gateway:
            await publisher.start()
        else:
            publisher.started = True
        await asyncio.wait((source_task, synced), return_when=asyncio.FIRST_COMPLETED)
        if not synced.done():
            source_task.result()  # the source ended before its first full view: say why
            raise RuntimeError("the source ended before its first full view")
    finally:
        for task in (source_task, synced):
            task.cancel()
        await asyncio.gather(source_task, synced, return_exceptions=True)
    if gateway is not None:
        await _gateway_ready(publisher, gateway)
    await publisher.sync_once(publisher.queue.take_ready())
    await publisher.outbox.write_all()
