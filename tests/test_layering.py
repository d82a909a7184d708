"""The import arrows of STYLE §1. `lint-imports` (import-linter, the contracts in pyproject.toml's
[tool.importlinter]) holds most: no cycle, the pure core does no I/O, adapters and edges never
import the stages, no gateway imports another, only kube talks to Kubernetes. Two rules stay here,
read with `ast`, because an import-linter contract names the modules it forbids and these forbid
"everything but": model imports nothing of ours but quantity, addresses and values, which (with
durations) import nothing of ours at all; and the loop imports no
adapter but the seam (adapters.base); a module added later would slip past a list."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Beside the running python: the venv's own, whatever PATH holds.
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def test_import_contracts_hold():
    assert LINT_IMPORTS.exists(), f"{LINT_IMPORTS} is missing: install the [test] extra (import-linter)"
    # This checkout's packages first, whichever copy the environment has installed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr


def modules() -> dict[str, set[str]]:
    found = {}
    for package in ("publisher", "adapters"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            imports: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    imports |= {alias.name for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    imports.add(node.module)
                    imports |= {f"{node.module}.{alias.name}" for alias in node.names}
            found[name] = imports
    return found


MODULES = modules()


def imported(module: str, prefix: str) -> bool:
    return any(i == prefix or i.startswith(prefix + ".") for i in MODULES[module])


# The leaves of the pure core: each imports nothing of ours but the leaves named here.
LEAVES = {
    "publisher.core.quantity": (),
    "publisher.core.durations": (),
    "publisher.core.addresses": (),
    "publisher.core.values": (),
    "publisher.core.model": ("publisher.core.quantity", "publisher.core.addresses", "publisher.core.values"),
}


@pytest.mark.parametrize("module", sorted(LEAVES))
def test_model_and_quantity_import_nothing_else_of_ours(module):
    ours = {i for i in MODULES[module] if i.split(".")[0] in ("publisher", "adapters")}
    assert not {i for i in ours if not any(imported_from(i, leaf) for leaf in LEAVES[module])}, ours


def imported_from(name: str, module: str) -> bool:
    return name == module or name.startswith(module + ".")


@pytest.mark.parametrize("loop_module", sorted(m for m in MODULES if m == "publisher.loop" or m.startswith("publisher.loop.")))
def test_loop_uses_no_concrete_adapter(loop_module):
    concrete = sorted(m for m in MODULES if m.startswith("adapters.") and m != "adapters.base")
    assert not [m for m in concrete if imported(loop_module, m)]
