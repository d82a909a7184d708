"""Gateway adapters: one module per gateway behind `adapters.base.Adapter`.

`ADAPTERS` maps an adapter name to where its options model and class live; it is the only list of
adapters (the CLI's `--adapter` choices and the Helm values schema are checked against it). A
module is imported only when its adapter is chosen, so importing `adapters.base` stays cheap.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from adapters.base import Adapter, AdapterError, ApplyResult, Rejected, Unavailable, write_atomic

__all__ = [
    "ADAPTERS",
    "Adapter",
    "AdapterError",
    "AdapterSpec",
    "ApplyResult",
    "Rejected",
    "Unavailable",
    "write_atomic",
]


@dataclass(frozen=True)
class AdapterSpec:
    module: str
    adapter_class: str
    options_class: str

    def load(self) -> tuple[type[Any], type[Any]]:
        """(options model, adapter class)."""
        module = importlib.import_module(self.module)
        return getattr(module, self.options_class), getattr(module, self.adapter_class)


ADAPTERS: dict[str, AdapterSpec] = {
    "envoy": AdapterSpec("adapters.envoy", "EnvoyAdapter", "EnvoyOptions"),
    "httproute": AdapterSpec("adapters.httproute", "HttpRouteAdapter", "HttpRouteOptions"),
    "json": AdapterSpec("adapters.json_file", "JsonAdapter", "JsonOptions"),
    "nginx": AdapterSpec("adapters.nginx", "NginxAdapter", "NginxOptions"),
}
