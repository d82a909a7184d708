"""pytest fixtures for the fake Kubernetes API: import `kube_api` and `kubeconfig` into a conftest."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.fakes.kube_api import FakeKubeAPI, write_kubeconfig

# Short enough that a test waiting for a bookmark does not wait long; real servers send about one a minute.
TEST_BOOKMARK_INTERVAL = 0.2


@pytest.fixture
async def kube_api() -> AsyncIterator[FakeKubeAPI]:
    """A started fake API server, stopped (watches ended, port closed) when the test ends."""
    async with FakeKubeAPI(bookmark_interval=TEST_BOOKMARK_INTERVAL) as api:
        yield api


@pytest.fixture
def kubeconfig(kube_api: FakeKubeAPI, tmp_path: Path) -> Path:
    """A kubeconfig file whose current context points at `kube_api`."""
    return write_kubeconfig(tmp_path / "kubeconfig", kube_api.url)
