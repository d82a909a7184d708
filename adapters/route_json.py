"""Pure: one map's Route as JSON, and back. The JSON gateway writes it; Envoy's file mode and
NGINX's reload mode keep it beside what they render, to read back what they wrote."""

from __future__ import annotations

from typing import Any

from publisher.core.values import Backend, MapKey, Route

__all__ = ["from_json", "to_json"]


def to_json(key: MapKey, route: Route) -> dict[str, Any]:
    return {
        "namespace": key.namespace,
        "name": key.name,
        "hostname": route.hostname,
        "backends": [{"cluster": b.cluster, "endpoint": b.endpoint, "weight": b.weight} for b in route.backends],
    }


def from_json(data: Any) -> tuple[MapKey, Route]:
    """Reads back what the renderer wrote; raises ValueError on anything else."""
    try:
        backends = tuple(
            Backend(cluster=_text(b["cluster"]), endpoint=_text(b["endpoint"]), weight=_whole(b["weight"])) for b in data["backends"]
        )
        return MapKey(_text(data["namespace"]), _text(data["name"])), Route(_text(data["hostname"]), backends)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a route: {exc!r}") from exc


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a string")
    return value


def _whole(value: Any) -> int:
    if type(value) is not int:
        raise ValueError(f"{value!r} is not an integer")
    return value


# The longest file name Linux filesystems take; `_replace` adds 5 characters for its temp file.
