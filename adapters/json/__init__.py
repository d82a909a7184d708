"""Adapter `json`: routes as JSON, for tests and for gateways that read files.

Two transports share one renderer. `--json-path FILE`: every route in one file
`{"publications": [...]}`, sorted by namespace and name, rewritten whole on each change (for small
fleets). `--json-dir DIR`: one file per map, `<namespace>_<name>.json` (neither part may hold `_`),
written atomically and removed on withdrawal, plus `index.json` with a write counter and the count
of maps: O(1) per change. A read-back (start, resync) rewrites an index that is missing, does not
parse or miscounts the maps, and its counter never goes backwards. Either way a write is confirmed by reading the files back, and what is
read back at start or resync is what the files hold; a file that does not parse serves nothing.

Owns the one file (--json-path) or the directory (--json-dir) it writes. Imports the standard
library, pydantic, adapters.base, adapters.route_json and publisher.core.values only.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from adapters.base import TransportDefaults, Unavailable, WriteResult, write_atomic
from adapters.route_json import from_json, to_json
from publisher.core.values import MapKey, Route

INDEX_FILE = "index.json"
# Writes of at most this many map files run on the event loop; larger ones in a thread.
INLINE_WRITES = 4


class JsonOptions(BaseModel):
    model_config = ConfigDict(frozen=True)

    json_path: Path | None = Field(None, description="One file holding every route, rewritten whole on each change (small fleets).")
    json_dir: Path | None = Field(None, description="A directory with one file per map, O(1) per change (large fleets).")

    @model_validator(mode="after")
    def _one_target(self) -> JsonOptions:
        if (self.json_path is None) == (self.json_dir is None):
            raise ValueError("give exactly one of --json-path and --json-dir")
        return self


NAME_MAX = 255


class JsonRenderer:
    """Each map's route as one encoded JSON object; with `per_map_files`, each in a file named
    after the map (--json-dir), whose name must fit the filesystem."""

    def __init__(self, *, per_map_files: bool = False) -> None:
        self._per_map_files = per_map_files

    def problem(self, key: MapKey, route: Route) -> str | None:
        if self._per_map_files and len(_temp_name(map_file(key)).encode()) > NAME_MAX:
            return f"the map's file name {map_file(key)} is longer than the {NAME_MAX - 5} characters a --json-dir file name can have"
        return None

    def render(self, key: MapKey, route: Route) -> bytes:
        return json.dumps(to_json(key, route), separators=(",", ":")).encode()


def assemble(parts: Mapping[MapKey, bytes]) -> bytes:
    """The single file from each map's part, in namespace/name order."""
    body = b",\n".join(parts[key] for key in sorted(parts))
    return b'{"publications": [\n' + body + b"\n]}\n" if body else b'{"publications": []}\n'


def parse(data: bytes) -> dict[MapKey, Route]:
    document = json.loads(data)
    return dict(from_json(item) for item in document["publications"])


class JsonFileTransport(TransportDefaults):
    """Every route in one file, replaced by rename."""

    def __init__(self, path: Path) -> None:
        self._path = path

    async def read(self) -> dict[MapKey, Route]:
        return await asyncio.to_thread(self._read)

    def _read(self) -> dict[MapKey, Route]:
        try:
            data = self._path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise Unavailable(f"cannot read {self._path}: {exc}") from exc
        try:
            return parse(data)
        except (ValueError, KeyError, TypeError):
            # A file that does not parse serves nothing; the engine writes the routes back.
            return {}

    async def write(self, parts: Mapping[MapKey, bytes], changes: Mapping[MapKey, bytes | None]) -> WriteResult:
        data = assemble(parts)
        await asyncio.to_thread(self._write, data)
        return WriteResult()

    def _write(self, data: bytes) -> None:
        try:
            write_atomic(self._path, data)
            confirmed = self._path.read_bytes()
        except OSError as exc:
            raise Unavailable(f"cannot write {self._path}: {exc}") from exc
        if confirmed != data:
            raise Unavailable(f"{self._path} changed under us while writing")


def map_file(key: MapKey) -> str:
    return f"{key.namespace}_{key.name}.json"


class JsonDirTransport(TransportDefaults):
    """One file per map and a small index; a write touches only the changed maps' files."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self._version = 0
        self._count = 0

    async def read(self) -> dict[MapKey, Route]:
        return await asyncio.to_thread(self._read)

    def _read(self) -> dict[MapKey, Route]:
        routes: dict[MapKey, Route] = {}
        try:
            names = os.listdir(self._dir)
            index = self._read_index()
        except OSError as exc:
            raise Unavailable(f"cannot read {self._dir}: {exc}") from exc
        for name in names:
            if not name.endswith(".json") or name == INDEX_FILE or name.startswith("."):
                continue
            try:
                key, route = from_json(json.loads((self._dir / name).read_bytes()))
            except (OSError, ValueError):
                continue
            if map_file(key) == name:
                routes[key] = route
        self._count = len(routes)
        if index is not None and index["maps"] == self._count and index["version"] >= self._version:
            self._version = index["version"]
            return routes
        if index is None and self._count == 0 and self._version == 0:
            return routes  # a new directory: the first write writes the index
        if index is None and self._version == 0:
            # A lost index after a restart: its counter is unknown, so it goes on from the clock's
            # seconds, which no write counter reaches, never below an earlier version.
            self._version = int(time.time())
        self._version = max(self._version, index["version"] if index else 0)
        try:
            self._write_index()
        except OSError as exc:
            raise Unavailable(f"cannot write {self._dir / INDEX_FILE}: {exc}") from exc
        return routes

    def _read_index(self) -> dict[str, int] | None:
        """The index's version and map count, or None when it is missing or not one we wrote."""
        try:
            index = json.loads((self._dir / INDEX_FILE).read_bytes())
        except (FileNotFoundError, ValueError):
            return None
        if not isinstance(index, dict) or set(index) != {"version", "maps"} or any(type(v) is not int for v in index.values()):
            return None
        return index

    def _write_index(self) -> None:
        self._version += 1
        _replace(self._dir / INDEX_FILE, json.dumps({"version": self._version, "maps": self._count}).encode() + b"\n")

    async def write(self, parts: Mapping[MapKey, bytes], changes: Mapping[MapKey, bytes | None]) -> WriteResult:
        if len(changes) <= INLINE_WRITES:
            # A few small files cost a few syscalls (about 50 us each here): less than handing
            # them to a thread, which waits for the interpreter lock behind the watch's decoding.
            self._write(changes)
        else:
            await asyncio.to_thread(self._write, changes)
        return WriteResult()

    def _write(self, changes: Mapping[MapKey, bytes | None]) -> None:
        try:
            for key, part in changes.items():
                path = self._dir / map_file(key)
                existed = path.exists()
                if part is None:
                    if existed:
                        path.unlink()
                        self._count -= 1
                    continue
                _replace(path, part + b"\n")
                self._count += 0 if existed else 1
            self._write_index()
        except OSError as exc:
            raise Unavailable(f"cannot write in {self._dir}: {exc}") from exc


def _temp_name(name: str) -> str:
    return f".{name}.tmp"


def _replace(path: Path, data: bytes) -> None:
    """Replace `path` by rename, then read it back. Cheaper than write_atomic, which the per-map
    files do not need: the engine is their one writer (a fixed temp name is safe), and it reads
    every file back at start and rewrites what a crash lost, so no fsync either (two fsyncs cost
    more than the whole rest of an update)."""
    tmp = path.with_name(_temp_name(path.name))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    with open(path, "rb") as confirmed:
        if confirmed.read() != data:
            raise Unavailable(f"{path} changed under us while writing")


def build(options: JsonOptions) -> tuple[JsonRenderer, JsonFileTransport | JsonDirTransport]:
    if options.json_dir is not None:
        return JsonRenderer(per_map_files=True), JsonDirTransport(options.json_dir)
    assert options.json_path is not None
    return JsonRenderer(), JsonFileTransport(options.json_path)
