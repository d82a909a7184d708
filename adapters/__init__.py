"""Gateway adapters: one module per gateway behind `adapters.base.Adapter`.

`ADAPTERS` maps an adapter name to its module's `from_options` constructor; it is the only list of
adapters (the CLI's `--adapter` choices and the Helm schema are checked against it).
"""

from adapters.base import AdapterError, Adapter, ApplyResult, Rejected, Unavailable, write_atomic

__all__ = ["ADAPTERS", "Adapter", "AdapterError", "ApplyResult", "Rejected", "Unavailable", "write_atomic"]

ADAPTERS: tuple[str, ...] = ("envoy", "httproute", "json", "nginx")
