"""The import arrows of STYLE §1, read with `ast`: a wrong-way import fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PURE = {"publisher.model", "publisher.quantity", "publisher.weights", "publisher.gate", "publisher.verify", "publisher.plan", "publisher.split"}
IO_LIBRARIES = {"asyncio", "aiohttp", "kubernetes_asyncio", "prometheus_client", "logging", "subprocess", "socket"}
STAGES = {"publisher.gate", "publisher.verify", "publisher.plan", "publisher.loop"}
EDGES = {"publisher.kube", "publisher.source", "publisher.status", "publisher.region_report", "publisher.fleet"}


def modules() -> dict[str, set[str]]:
    found = {}
    for package in ("publisher", "adapters"):
        for path in sorted((ROOT / package).glob("*.py")):
            name = f"{package}.{path.stem}" if path.stem != "__init__" else package
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


@pytest.mark.parametrize("module", sorted(PURE))
def test_pure_modules_do_no_io(module):
    bad = sorted(i for i in MODULES[module] if i.split(".")[0] in IO_LIBRARIES)
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize("module", ["publisher.model", "publisher.quantity"])
def test_model_and_quantity_import_nothing_else_of_ours(module):
    ours = {i for i in MODULES[module] if i.split(".")[0] in ("publisher", "adapters")}
    assert ours <= {"publisher.quantity", "publisher.quantity.QuantityError", "publisher.quantity.parse_quantity"}, ours


@pytest.mark.parametrize("module", sorted(EDGES | {m for m in MODULES if m.startswith("adapters.")}))
def test_edges_never_import_the_stages(module):
    bad = sorted(stage for stage in STAGES if imported(module, stage))
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("adapters.")))
def test_adapters_see_publications_not_metrics(module):
    assert not imported(module, "publisher.metrics")
    assert not imported(module, "publisher.source")


def test_loop_uses_no_concrete_adapter():
    concrete = sorted(m for m in MODULES if m.startswith("adapters.") and m != "adapters.base")
    assert not [m for m in concrete if imported("publisher.loop", m)]


def test_only_kube_imports_kubernetes_asyncio():
    users = sorted(m for m in MODULES if imported(m, "kubernetes_asyncio"))
    assert users == ["publisher.kube"]
