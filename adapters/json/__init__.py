"""Adapter `json`: routes as JSON, for tests and for gateways that read files.

Two transports share one renderer. `--json-path FILE`: every route in one file
`{"publications": [...]}`, sorted by namespace and name, rewritten whole on each change (for small
fleets). `--json-dir DIR`: one file per map, `<namespace>_<name>.json` (neither part may hold `_`),
written atomically and removed on withdrawal, plus `index.json` with a write counter and the count
of maps: O(1) per change. A read-back (start, resync) rewrites an index that is missing, does not
parse or miscounts the maps, and its counter never goes backwards. Either way a write is confirmed by reading the files back, and what is
read back at start or resync is what the files hold; a file that does not parse serves nothing.

Owns the one file (--json-path) or the directory (--json-dir) it writes. Imports the standard
library, pydantic, adapters.base, adapters.route_json and publisher.core.model only.

- __init__.py: the options and `build`, for the registry (adapters.ADAPTERS).
- render.py: the renderer (pure), the single file assembled and parsed, a map's file name.
- transport.py: the two transports, `JsonFileTransport` (--json-path) and `JsonDirTransport` (--json-dir).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from adapters.json.render import JsonRenderer
from adapters.json.transport import JsonDirTransport, JsonFileTransport

__all__ = ["JsonOptions", "build"]


class JsonOptions(BaseModel):
    model_config = ConfigDict(frozen=True)

    json_path: Path | None = Field(None, description="One file holding every route, rewritten whole on each change (small fleets).")
    json_dir: Path | None = Field(None, description="A directory with one file per map, O(1) per change (large fleets).")

    @model_validator(mode="after")
    def _one_target(self) -> JsonOptions:
        if (self.json_path is None) == (self.json_dir is None):
            raise ValueError("give exactly one of --json-path and --json-dir")
        return self


def build(options: JsonOptions) -> tuple[JsonRenderer, JsonFileTransport | JsonDirTransport]:
    if options.json_dir is not None:
        return JsonRenderer(per_map_files=True), JsonDirTransport(options.json_dir)
    assert options.json_path is not None
    return JsonRenderer(), JsonFileTransport(options.json_path)
