"""`DirectorySource`: manifests in one directory, re-read when a file changes."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from publisher import metrics
from publisher.core.model import INFERENCE_SERVICE_KIND, TRAFFIC_MAP_KIND, InferenceService, object_key, parse_traffic_map
from publisher.core.values import MapKey
from publisher.source.manifests import ManifestError, read_manifests
from publisher.source.objects import parse_isvc
from publisher.source.store import ChangeSink, MapObject, Stores

log = logging.getLogger("publisher.source")  # the logger name these logs have always printed

_MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")


@dataclass(frozen=True)
class _FileState:
    signature: tuple[int, int, int]
    maps: tuple[tuple[MapKey, MapObject, str], ...]
    isvcs: tuple[tuple[MapKey, InferenceService, str], ...]


class DirectorySource:
    """Manifests in one directory (not recursive), re-read when a file's size or mtime changes.

    A file that fails to parse is reported and skipped; the objects it held before stay as they
    were, so its maps keep their last state while the other files' maps move on.
    """

    def __init__(self, path: Path, stores: Stores, sink: ChangeSink, *, clock: Callable[[], float], poll_interval: float = 0.5) -> None:
        self._path = path
        self._stores = stores
        self._sink = sink
        self._clock = clock
        # Half a second keeps a change visible within a second without a filesystem-events dependency.
        self._poll_interval = poll_interval
        self._files: dict[str, _FileState] = {}
        self._bad: dict[str, tuple[tuple[int, int, int], str]] = {}

    def problem(self) -> str | None:
        """The first manifest file skipped now, and why (None: every file was read)."""
        return next((error for _, (_, error) in sorted(self._bad.items())), None)

    async def run(self) -> None:
        await self.scan()
        self._sink.synced()
        while True:
            await asyncio.sleep(self._poll_interval)
            await self.scan()

    async def scan(self) -> None:
        """Read what changed since the last scan, then update the Stores in one step."""
        started = self._clock()
        changed = await asyncio.to_thread(self._scan_files)
        if not changed:
            return
        maps = [item for state in self._files.values() for item in state.maps]
        isvcs = [item for state in self._files.values() for item in state.isvcs]
        map_keys = self._stores.maps.replace(maps)
        # As MappedOnly: an InferenceService that no map names changes no decision.
        isvc_keys = {mapped for key in self._stores.isvcs.replace(isvcs) for mapped in self._stores.maps.naming(key)}
        keys = map_keys | isvc_keys
        if keys:
            self._sink.changed(keys, at=started)

    def _scan_files(self) -> bool:
        try:
            names = sorted(e.name for e in os.scandir(self._path) if e.is_file() and e.name.endswith(_MANIFEST_SUFFIXES) and not e.name.startswith("."))
        except OSError as exc:
            log.error("manifest directory unreadable", extra={"path": str(self._path), "error": str(exc)})
            return False
        changed = False
        for name in [n for n in self._files if n not in names]:
            del self._files[name]
            changed = True
        for name in [n for n in self._bad if n not in names]:
            del self._bad[name]
        for name in names:
            path = self._path / name
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            signature = (st.st_mtime_ns, st.st_size, st.st_ino)
            known = self._files.get(name)
            if known is not None and known.signature == signature:
                continue
            if name in self._bad and self._bad[name][0] == signature:
                continue
            try:
                state = self._read(path, signature)
            except (ManifestError, OSError, ValueError) as exc:
                self._bad[name] = (signature, str(exc))
                metrics.SOURCE_ERRORS.labels(source="dir").inc()
                log.error("manifest file skipped", extra={"path": str(path), "error": str(exc)})
                continue
            self._bad.pop(name, None)
            self._files[name] = state
            changed = True
        return changed

    @staticmethod
    def _read(path: Path, signature: tuple[int, int, int]) -> _FileState:
        objects = read_manifests(path)
        maps, isvcs = [], []
        for raw in objects:
            kind, key = raw.get("kind"), object_key(raw)
            if key is None:
                continue
            # An object's content is its version: a rewritten file with the same object is no change.
            version = hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()
            if kind == TRAFFIC_MAP_KIND:
                maps.append((key, parse_traffic_map(raw), version))
            elif kind == INFERENCE_SERVICE_KIND:
                isvc = parse_isvc(raw)
                if isvc is not None:
                    isvcs.append((key, isvc, version))
        return _FileState(signature, tuple(maps), tuple(isvcs))
