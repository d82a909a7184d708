"""The scripts under benchmarks/ (scripts, not a package), for the tests that run them or load
their pure parts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def script(name: str) -> Path:
    return BENCHMARKS / f"{name}.py"


def load(name: str) -> ModuleType:
    """benchmarks/NAME.py as the module `benchmark_NAME`."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", script(name))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script loads
    spec.loader.exec_module(module)
    return module
