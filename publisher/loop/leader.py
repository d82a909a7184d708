"""Lease-based leader election for status writes.

Owns the Lease while it runs (its last renewal lives in the task); what it wins or loses it tells
the Publisher's status outbox (`lead`, `follow`), which owns whether this replica writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import aiohttp

from publisher import status
from publisher.kube import Kube, KubeError, LeaseLock
from publisher.loop.pipeline import Publisher

log = logging.getLogger("publisher.loop")


@dataclass(frozen=True)
class LeaderOptions:
    """Lease-based leader election for status writes (client-go's default timings). Every Lease
    call must end before the renew deadline, which ends before the lease does: a leader that
    cannot renew stops writing status while its lease still holds."""

    lease_namespace: str
    identity: str
    lease_duration: int = 15
    renew_deadline: int = 10
    retry_period: int = 2


# Failures of one Lease attempt: all retried, none may end the process.
_LEASE_FAULTS = (KubeError, OSError, TimeoutError, aiohttp.ClientError)


async def run_leader_election(publisher: Publisher, kube: Kube, options: LeaderOptions) -> None:
    """Compete for the Lease forever; only while holding it does `publisher` write status. API
    faults are retried every retry period; the Lease is released when this task is cancelled."""
    lock = LeaseLock(kube, options.lease_namespace, status.field_manager(publisher.options.region), options.identity)
    last_renew: float | None = None
    problem: str | None = None

    def stop(why: str) -> None:
        nonlocal last_renew
        last_renew = None
        publisher.outbox.follow()
        log.warning("lost the lease: status writes stop", extra={"identity": options.identity, "reason": why})

    try:
        while True:
            attempt_started = time.monotonic()
            # While leading, an attempt may not outlive the renew deadline; acquiring has as long.
            budget = options.renew_deadline if last_renew is None else last_renew + options.renew_deadline - attempt_started
            try:
                async with asyncio.timeout(max(0.05, budget)):
                    held = await lock.try_acquire_or_renew(options.lease_duration)
            except _LEASE_FAULTS as exc:
                held = False
                why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                if why != problem:
                    log.warning("lease call failed, retrying", extra={"identity": options.identity, "error": why})
                problem = why
            else:
                problem = None
            now = time.monotonic()
            if held:
                if last_renew is None:
                    log.info("leading: writing status", extra={"identity": options.identity})
                    publisher.outbox.lead()
                last_renew = now
            elif last_renew is not None and (problem is None or now - last_renew >= options.renew_deadline):
                stop("another replica holds the lease" if problem is None else f"not renewed within {options.renew_deadline}s: {problem}")
            await asyncio.sleep(max(0.0, options.retry_period - (now - attempt_started)))
    finally:
        if last_renew is not None:
            publisher.outbox.follow()
            with contextlib.suppress(*_LEASE_FAULTS):
                async with asyncio.timeout(options.retry_period):
                    await lock.release()
                log.info("lease released", extra={"identity": options.identity})
