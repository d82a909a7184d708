"""A bridge for adapters not yet split into a renderer and a transport: the whole old adapter
serves as the transport, and a map's part is its route. Goes away with the last such adapter."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adapters.base import WriteResult
from publisher.model import MapKey, Publication, Route


def _publication(key: MapKey, route: Route) -> Publication:
    return Publication(key.namespace, key.name, route.hostname, 0, 0, route.backends)


class LegacyRenderer:
    def __init__(self, adapter: Any) -> None:
        self._adapter = adapter

    def problem(self, key: MapKey, route: Route) -> str | None:
        held = self._adapter.check(_publication(key, route))
        return held.message if held is not None else None

    def render(self, key: MapKey, route: Route) -> Route:
        return route


class LegacyTransport:
    def __init__(self, adapter: Any) -> None:
        self._adapter = adapter

    async def read(self) -> dict[MapKey, Route]:
        return {key: pub.route for key, pub in (await self._adapter.current()).items()}

    async def write(self, parts: Mapping[MapKey, Route], changes: Mapping[MapKey, Route | None]) -> WriteResult:
        desired = {key: _publication(key, route) for key, route in parts.items()}
        result = await self._adapter.apply(desired, frozenset(changes))
        return WriteResult(rejected=dict(result.rejected), notes=dict(result.notes), reloads=result.reloads)

    def hold_off(self) -> float:
        return float(self._adapter.hold_off())

    def unready(self) -> str | None:
        return None

    async def serve(self) -> None:
        return None

    async def aclose(self) -> None:
        await self._adapter.aclose()


def build_legacy(adapter_class: Any, options: Any) -> tuple[LegacyRenderer, LegacyTransport]:
    adapter = adapter_class(options)
    return LegacyRenderer(adapter), LegacyTransport(adapter)
