"""Suite-wide guards: a test may not leave asyncio tasks running behind it."""

from __future__ import annotations

import asyncio

import pytest


@pytest.fixture(autouse=True)
async def no_leaked_tasks():
    yield
    # Let tasks cancelled in the test's own teardown finish unwinding before counting.
    for _ in range(3):
        await asyncio.sleep(0)
    leaked = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
    for task in leaked:
        task.cancel()
    assert not leaked, f"test left tasks running: {leaked}"


from tests.fakes.fixtures import kube_api, kubeconfig  # noqa: E402, F401  (fixtures for every test)
