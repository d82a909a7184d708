"""Adapter `json`'s renderer (pure): each map's route as one encoded JSON object, the single
file of `--json-path` assembled from them and parsed back, and the file name of a map under
`--json-dir`."""

from __future__ import annotations

import json
from collections.abc import Mapping

from adapters.route_json import from_json, to_json
from publisher.core.values import MapKey, Route

__all__ = ["NAME_MAX", "JsonPart", "JsonRenderer", "assemble", "map_file", "parse", "temp_name"]

NAME_MAX = 255


class JsonPart(bytes):
    """A map's encoded JSON object, carrying the Route it encodes (`route`, not part of its value):
    a read-back that finds these bytes in the map's file serves that Route, with nothing parsed."""

    route: Route

    def __new__(cls, data: bytes, route: Route) -> JsonPart:
        part = super().__new__(cls, data)
        part.route = route
        return part


class JsonRenderer:
    """Each map's route as one encoded JSON object; with `per_map_files`, each in a file named
    after the map (--json-dir), whose name must fit the filesystem."""

    def __init__(self, *, per_map_files: bool = False) -> None:
        self._per_map_files = per_map_files

    def problem(self, key: MapKey, route: Route) -> str | None:
        if self._per_map_files and len(temp_name(map_file(key)).encode()) > NAME_MAX:
            return f"the map's file name {map_file(key)} is longer than the {NAME_MAX - 5} characters a --json-dir file name can have"
        return None

    def render(self, key: MapKey, route: Route) -> JsonPart:
        return JsonPart(json.dumps(to_json(key, route), separators=(",", ":")).encode(), route)


def assemble(parts: Mapping[MapKey, bytes]) -> bytes:
    """The single file from each map's part, in namespace/name order."""
    body = b",\n".join(parts[key] for key in sorted(parts))
    return b'{"publications": [\n' + body + b"\n]}\n" if body else b'{"publications": []}\n'


def parse(data: bytes) -> dict[MapKey, Route]:
    document = json.loads(data)
    return dict(from_json(item) for item in document["publications"])


def map_file(key: MapKey) -> str:
    return f"{key.namespace}_{key.name}.json"


def temp_name(name: str) -> str:
    return f".{name}.tmp"
