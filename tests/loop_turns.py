"""How often other tasks got the event loop while a block ran: the structural check for "no
coroutine holds the event loop", with no timing in it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable


@contextlib.asynccontextmanager
async def loop_turns() -> AsyncIterator[Callable[[], int]]:
    """Yields a function giving the turns a ticker task got since it was last reset (`turns(reset=True)`
    starts a new count): a block that never gives the loop back leaves it at 0 or 1."""
    ticks = 0
    start = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    def turns(reset: bool = False) -> int:
        nonlocal start
        if reset:
            start = ticks
        return ticks - start

    task = asyncio.create_task(ticker())
    try:
        await asyncio.sleep(0)
        start = ticks
        yield turns
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
