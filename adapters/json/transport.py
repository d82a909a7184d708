"""Adapter `json`'s transports: `JsonFileTransport` rewrites the one file of --json-path whole;
`JsonDirTransport` writes one file per map under --json-dir and keeps its index. Each confirms a
write by reading the files back."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Collection, Mapping
from pathlib import Path

from adapters.base import TransportDefaults, Unavailable, WriteResult, write_atomic
from adapters.json.render import JsonPart, assemble, map_file, parse, temp_name
from adapters.route_json import from_json
from publisher.core.values import MapKey, Route

INDEX_FILE = "index.json"
# Writes of at most this many map files run on the event loop; larger ones in a thread.
INLINE_WRITES = 4
# A file's timestamps move in ticks (a few ms on Linux): one changed this recently is parsed again.
RACY_NS = 2_000_000_000

_Signature = tuple[int, int, int, int]  # inode, size, mtime and ctime in ns


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


class JsonDirTransport(TransportDefaults):
    """One file per map and a small index; a write touches only the changed maps' files."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self._version = 0
        self._count = 0
        # What the last read parsed, by file name, with the file's signature then: a resync reads
        # back every map, and parsing 10,000 files held the applier (and the interpreter's lock)
        # for about a second; a file whose signature did not change is not read again.
        self._parsed: dict[str, tuple[_Signature, MapKey, Route]] = {}
        # What was written to each file since a read last took it in: a file found to hold
        # exactly these bytes serves their Route (the first resync after a first publish parsed
        # all 10,000 files).
        self._wrote: dict[str, tuple[MapKey, JsonPart]] = {}

    async def read(self) -> dict[MapKey, Route]:
        return await asyncio.to_thread(self._read)

    async def read_page(self, keys: Collection[MapKey]) -> dict[MapKey, Route]:
        """What the files of `keys` hold. On the event loop: a page is a few hundred stats, and
        a file is parsed only when it changed since it was last read."""
        routes: dict[MapKey, Route] = {}
        settled = time.time_ns() - RACY_NS
        try:
            for key in keys:
                name = map_file(key)
                try:
                    stat = os.stat(os.path.join(self._dir, name))
                except FileNotFoundError:
                    self._parsed.pop(name, None)
                    continue
                found = self._route_of(name, stat, settled, self._parsed)
                if found is not None:
                    routes[key] = found[1]  # the file is named for its map: found[0] is key
        except OSError as exc:
            raise Unavailable(f"cannot read {self._dir}: {exc}") from exc
        return routes

    async def read_others(self, known: Collection[MapKey]) -> dict[MapKey, Route]:
        names = {map_file(key) for key in known}
        return await asyncio.to_thread(self._read_others, names)

    def _read(self) -> dict[MapKey, Route]:
        parsed: dict[str, tuple[_Signature, MapKey, Route]] = {}
        routes = self._scan(set(), parsed)
        self._parsed = parsed
        return routes

    def _read_others(self, names: set[str]) -> dict[MapKey, Route]:
        return self._scan(names, self._parsed)

    def _scan(self, names: set[str], parsed: dict[str, tuple[_Signature, MapKey, Route]]) -> dict[MapKey, Route]:
        """The maps in the directory's files but `names` (counted, not read), each kept in
        `parsed`; the index checked against the count of map files."""
        routes: dict[MapKey, Route] = {}
        listed = 0
        settled = time.time_ns() - RACY_NS
        try:
            index = self._read_index()
            with os.scandir(self._dir) as entries:
                for entry in entries:
                    name = entry.name
                    if name in names:
                        listed += 1
                        continue
                    if not _is_map_file(name):
                        continue
                    try:
                        stat = entry.stat()
                    except OSError:
                        continue
                    found = self._route_of(name, stat, settled, parsed)
                    if found is not None:
                        routes[found[0]] = found[1]
        except OSError as exc:
            raise Unavailable(f"cannot read {self._dir}: {exc}") from exc
        self._settle_index(index, listed + len(routes))
        return routes

    def _route_of(self, name: str, stat: os.stat_result, settled: int, parsed: dict[str, tuple[_Signature, MapKey, Route]]) -> tuple[MapKey, Route] | None:
        """The map a file serves, parsed only when its signature moved since the last read; kept
        in `parsed` once its timestamps are older than `settled`. None: not a map's file (what it
        holds is unreadable, or it is named for another map)."""
        signature = (stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
        kept = self._parsed.get(name)
        if kept is not None and kept[0] == signature:
            key, route = kept[1], kept[2]
        else:
            try:
                key, route = self._parse(name)
            except (OSError, ValueError):
                parsed.pop(name, None)
                return None
        if map_file(key) != name:
            parsed.pop(name, None)
            return None
        # A file changed within RACY_NS of the read may change again within the same timestamp
        # tick, its size unchanged: it is parsed again next time (git's "racily clean" entries).
        if stat.st_mtime_ns < settled and stat.st_ctime_ns < settled:
            parsed[name] = (signature, key, route)
            self._wrote.pop(name, None)
        else:
            parsed.pop(name, None)
        return key, route

    def _settle_index(self, index: dict[str, int] | None, count: int) -> None:
        """Take the count of map files read; write the index again when it is missing or says
        another count, its version never going back."""
        self._count = count
        if index is not None and index["maps"] == self._count and index["version"] >= self._version:
            self._version = index["version"]
            return
        if index is None and self._count == 0 and self._version == 0:
            return  # a new directory: the first write writes the index
        if index is None and self._version == 0:
            # A lost index after a restart: its counter is unknown, so it goes on from the clock's
            # seconds, which no write counter reaches, never below an earlier version.
            self._version = int(time.time())
        self._version = max(self._version, index["version"] if index else 0)
        try:
            self._write_index()
        except OSError as exc:
            raise Unavailable(f"cannot write {self._dir / INDEX_FILE}: {exc}") from exc

    def _parse(self, name: str) -> tuple[MapKey, Route]:
        data = (self._dir / name).read_bytes()
        wrote = self._wrote.get(name)
        if wrote is not None and len(data) == len(wrote[1]) + 1 and data.startswith(wrote[1]):
            return wrote[0], wrote[1].route
        return from_json(json.loads(data))

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
                name = map_file(key)
                path = self._dir / name
                existed = path.exists()
                self._wrote.pop(name, None)
                if part is None:
                    if existed:
                        path.unlink()
                        self._count -= 1
                    continue
                _replace(path, part + b"\n")
                if isinstance(part, JsonPart):
                    self._wrote[name] = (key, part)
                self._count += 0 if existed else 1
            self._write_index()
        except OSError as exc:
            raise Unavailable(f"cannot write in {self._dir}: {exc}") from exc


def _replace(path: Path, data: bytes) -> None:
    """Replace `path` by rename, then read it back. Cheaper than write_atomic, which the per-map
    files do not need: the engine is their one writer (a fixed temp name is safe), and it reads
    every file back at start and rewrites what a crash lost, so no fsync either (two fsyncs cost
    more than the whole rest of an update)."""
    tmp = path.with_name(temp_name(path.name))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    with open(path, "rb") as confirmed:
        if confirmed.read() != data:
            raise Unavailable(f"{path} changed under us while writing")


def _is_map_file(name: str) -> bool:
    return name.endswith(".json") and name != INDEX_FILE and not name.startswith(".")
