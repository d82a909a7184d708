"""Suite-wide guards: a test may not leave asyncio tasks running behind it, and no property test
depends on the day (a random seed, or an example a previous run stored)."""

from __future__ import annotations

import asyncio
import os

import pytest
from hypothesis import settings

# By default every property test and simulation runs the same fixed examples (derandomized, nothing
# read from or written to .hypothesis/), so a run passes or fails on the code alone. Random
# exploration is opt-in and longer: OME_SIMULATION_EXAMPLES=2000 (say) also turns randomness on.
# No deadline: a busy machine makes one example slow, and a test never depends on the machine's speed.
settings.register_profile("fixed", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("explore", derandomize=False, deadline=None, print_blob=True)
settings.load_profile("explore" if os.environ.get("OME_SIMULATION_EXAMPLES") else "fixed")


@pytest.fixture(autouse=True)
async def no_leaked_tasks():
    yield
    # Let tasks cancelled in the test's own teardown finish unwinding before counting.
    for _ in range(3):
        await asyncio.sleep(0)
    # One being cancelled is unwinding, not left running: gRPC's calls, cancelled by a channel's
    # close, end only when its poller thread says so (CI saw them still cancelling here).
    unwinding = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and t.cancelling()]
    if unwinding:
        await asyncio.wait(unwinding, timeout=5)
    leaked = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
    for task in leaked:
        task.cancel()
    assert not leaked, f"test left tasks running: {leaked}"


from tests.fakes.fixtures import kube_api, kubeconfig  # noqa: E402, F401  (fixtures for every test)
