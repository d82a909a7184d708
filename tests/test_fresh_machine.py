"""Issue 23, point 2: the suite is green on a fresh machine. Every module the tests import comes
from a distribution the project declares (a test dependency that only the machine's own Python
had made CI green while a fresh venv failed), and CI runs the README's test command in a virtual
environment of its own."""

from __future__ import annotations

import ast
import re
import shlex
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The project's own modules: its packages, and the scripts in tools/ and benchmarks/ that are
# imported by path (from beside them, or with their folder put on sys.path).
PROJECT_PACKAGES = {
    "publisher", "adapters", "tests", "benchmarks",
    *(path.stem for folder in ("tools", "benchmarks") for path in (ROOT / folder).glob("*.py")),
}


def _normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    return {_normalised(re.match(r"[A-Za-z0-9_.-]+", requirement).group()) for requirement in requirements}


def _imports_of_tests() -> dict[str, str]:
    """Each top-level module imported by the tests and the benchmarks they run, with one file importing it."""
    found: dict[str, str] = {}
    for path in sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.partition(".")[0], str(path.relative_to(ROOT)))
    return found


def test_every_module_the_tests_import_comes_from_a_declared_distribution():
    declared = _declared()
    providers = packages_distributions()
    undeclared = []
    for module, where in sorted(_imports_of_tests().items()):
        if module in sys.stdlib_module_names or module in PROJECT_PACKAGES or module == "__future__":
            continue
        if not {_normalised(dist) for dist in providers.get(module, ())} & declared:
            undeclared.append(f"{module} (imported by {where})")
    assert not undeclared, "not in the project's dependencies or its [test] extra: " + ", ".join(undeclared)


def test_every_declared_dependency_is_used_by_the_code():
    # A dependency declared and imported nowhere (tenacity was) is an install cost for nothing.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    imported: set[str] = set()
    for path in [*(ROOT / "publisher").rglob("*.py"), *(ROOT / "adapters").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.partition(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module.partition(".")[0])
    providers = packages_distributions()
    used = {_normalised(dist) for module in imported for dist in providers.get(module, ())}
    unused = [req for req in project["dependencies"] if _normalised(re.match(r"[A-Za-z0-9_.-]+", req).group()) not in used]
    assert not unused, f"declared but imported by no module of publisher/ or adapters/: {unused}"


def _readme_test_commands() -> list[str]:
    """The indented command lines of the README's "Run the tests" section."""
    section = (ROOT / "README.md").read_text().split("\n## Run the tests\n", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for line in section.splitlines() if line.startswith("    ")]


def test_ci_runs_the_readme_test_command_in_a_virtual_environment_of_its_own():
    script = (ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for line in script.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    readme = _readme_test_commands()
    assert readme[-1] == "python -m pytest -q"
    assert commands[-1] == readme[-1], "CI's last command is the README's test command"
    venv = [shlex.split(line) for line in commands if " -m venv " in f" {line} "]
    assert venv, "CI makes a virtual environment"
    # Not --system-site-packages: a package only the machine's Python has must fail CI too.
    assert all("--system-site-packages" not in argv for argv in venv)
    installs = [line for line in commands if "pip install" in line]
    assert installs and all(re.search(r"\"?\$\{?VENV\}?/bin/python\"? -m pip install", line) for line in installs), installs
    assert any(re.fullmatch(r'export PATH="\$\{?VENV\}?/bin:\$PATH"', line) for line in commands), "the venv's python first on PATH"
    # The README says the same: its install line goes into a venv whose python runs the tests.
    assert any(" -m venv " in f" {line} " for line in readme) and any("activate" in line for line in readme), readme


def test_the_readme_demo_installs_into_a_virtual_environment_first():
    """A fresh Debian machine's own Python refuses `pip install` outside a venv (PEP 668): the "Try it"
    commands make one and activate it before anything is installed."""
    section = (ROOT / "README.md").read_text().split("\n## Try it\n", 1)[1].split("\n## ", 1)[0]
    commands = [part.strip() for line in section.splitlines() if line.startswith("    ") for part in line.split("&&")]
    installs = [i for i, command in enumerate(commands) if command.startswith("pip install")]
    assert installs, commands
    venv = [i for i, command in enumerate(commands) if re.fullmatch(r"python3 -m venv \S+", command)]
    activate = [i for i, command in enumerate(commands) if re.fullmatch(r"\. \S+/bin/activate", command)]
    assert venv and activate and venv[0] < activate[0] < installs[0], commands
    assert "ome-publisher demo" in commands[installs[0] + 1:], commands
