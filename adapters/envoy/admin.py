"""Envoy's admin API, as file mode reads it: the version each xDS subscription last accepted, its
rejection counters, the clusters still warming, and the route configuration Envoy serves.

Owns the aiohttp session to one Envoy's admin address and nothing else: it decides nothing, writes
nothing and does not log. Imports the standard library, aiohttp and adapters.envoy.names only.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

import aiohttp

from adapters.envoy.names import STAT_PREFIX

__all__ = ["EnvoyAdmin", "PerSubscription"]


@dataclass(frozen=True, slots=True)
class PerSubscription:
    """One value for each xDS subscription we write: CDS and our RDS."""

    cds: Any
    rds: Any

    def of(self, what: str) -> Any:
        return self.cds if what == "cds" else self.rds


# Envoy's /stats walks every stat scope, even with a filter: at 40,000 clusters (10,000 maps) a counter
# query costs 0.5-1.5 s of Envoy's main thread, a text readout query (type=TextReadouts, a handful
# of readouts) about 0.1 s, and at 4,000 clusters 140 ms against 4 ms. So each write is confirmed
# from the version text readouts alone; the counters are read only when a version is slow to show.
_VERSION_TEXT = "version_text"
_UPDATE_REJECTED = "update_rejected"


class EnvoyAdmin:
    """Reads from one Envoy's admin API at `admin_url`, about route configuration `route_config`."""

    def __init__(self, admin_url: str, route_config: str) -> None:
        self._admin_url = admin_url.rstrip("/")
        self._rds_prefix = f"http.{STAT_PREFIX}.rds.{route_config}."
        self._session: aiohttp.ClientSession | None = None

    async def _get_json(self, path: str, timeout: float) -> Any:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        # The timeout is the caller's: Envoy answers its admin API on the thread that loads config,
        # so a query waits out a large update (40,000 new clusters take Envoy 25-45 s here).
        async with self._session.get(self._admin_url + path, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            response.raise_for_status()
            return await response.json(content_type=None)

    async def _stats(self, kind: str, suffix: str, timeout: float) -> PerSubscription:
        rds = re.escape(self._rds_prefix)
        query = f"/stats?format=json&type={kind}&filter=^(cluster_manager\\.cds\\.|{rds}){suffix}$"
        body = await self._get_json(query, timeout)
        values = {s["name"]: s["value"] for s in body.get("stats", []) if "name" in s}
        return PerSubscription(
            cds=values.get(f"cluster_manager.cds.{suffix}"), rds=values.get(f"{self._rds_prefix}{suffix}")
        )

    async def versions(self, timeout: float = 5.0) -> PerSubscription:
        """The version each subscription last accepted ("" before any): the cheap query."""
        values = await self._stats("TextReadouts", _VERSION_TEXT, timeout)
        return PerSubscription(cds=str(values.cds or ""), rds=str(values.rds or ""))

    async def rejections(self, timeout: float = 5.0) -> PerSubscription:
        """How many updates each subscription has rejected since Envoy started: the costly query."""
        values = await self._stats("Counters", _UPDATE_REJECTED, timeout)
        return PerSubscription(cds=int(values.cds or 0), rds=int(values.rds or 0))

    async def warming_clusters(self, timeout: float = 5.0) -> int:
        body = await self._get_json("/stats?format=json&type=Gauges&filter=^cluster_manager\\.warming_clusters$", timeout)
        return sum(int(s.get("value", 0)) for s in body.get("stats", []) if "name" in s)

    async def served_rds(self) -> str:
        """Envoy's active route configuration as an rds document, for `read_routes`. The dump is
        large at 10,000 maps: it is parsed off the event loop."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        url = self._admin_url + "/config_dump?resource=dynamic_route_configs"
        async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=30.0)) as response:
            response.raise_for_status()
            body = await response.read()
        return await asyncio.to_thread(self._rds_document, body)

    def _rds_document(self, body: bytes) -> str:
        for config in json.loads(body).get("configs", []):
            route_config = config.get("route_config", {})
            if self._rds_prefix == f"http.{STAT_PREFIX}.rds.{route_config.get('name')}.":
                return json.dumps({"version_info": config.get("version_info", ""), "resources": [route_config]})
        return json.dumps({"version_info": "", "resources": [{"virtual_hosts": []}]})

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
