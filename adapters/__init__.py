"""Gateway adapters: one module or package per gateway, a pure renderer plus a transport, run by the engine.

`ADAPTERS` maps an adapter name to the module holding its options model and its
`build(options) -> (renderer, transport)`; it is the only list of adapters (the CLI's `--adapter`
choices, the options the CLI offers and the Helm values schema follow it). A module is imported
only when its adapter is chosen, so importing `adapters.base` stays cheap.

Adding a gateway: a module (or a package, as adapters/envoy/, adapters/nginx/, adapters/json/ and
adapters/httproute/) with an options model (pydantic, each field prefixed with the adapter's name
and described), a Renderer, a Transport and `build`; then one line here. What two gateways share is a module of its own (listen, grpc_server,
route_json), never imported from another gateway (pyproject.toml's import contracts).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any

from adapters.base import Adapter, AdapterError, ApplyResult, Rejected, Renderer, Transport, Unavailable, WriteResult, write_atomic
from adapters.engine import Engine

__all__ = [
    "ADAPTERS",
    "Adapter",
    "AdapterError",
    "AdapterSpec",
    "ApplyResult",
    "Engine",
    "Rejected",
    "Renderer",
    "Transport",
    "Unavailable",
    "WriteResult",
    "write_atomic",
]


@dataclass(frozen=True)
class AdapterSpec:
    module: str
    options_class: str

    @functools.cached_property
    def _module(self) -> Any:
        return importlib.import_module(self.module)

    @property
    def options(self) -> type[Any]:
        """The adapter's options model."""
        return getattr(self._module, self.options_class)  # type: ignore[no-any-return]

    def engine(self, name: str, options: Any) -> Engine[Any]:
        """The gateway's renderer and transport, put together."""
        return Engine(name, *self._module.build(options))


ADAPTERS: dict[str, AdapterSpec] = {
    "envoy": AdapterSpec("adapters.envoy", "EnvoyOptions"),
    "httproute": AdapterSpec("adapters.httproute", "HttpRouteOptions"),
    "json": AdapterSpec("adapters.json", "JsonOptions"),
    "nginx": AdapterSpec("adapters.nginx", "NginxOptions"),
}
