"""Every package the code imports is declared in pyproject.toml, where the code that imports it runs."""

from __future__ import annotations

import ast
import importlib.metadata
import sys
from pathlib import Path

from requirements.lock import canonical, read_pyproject, requirement_name
from tests.support import ROOT

OWN = {"app", "modelrepo", "report", "devstack", "requirements", "tests", "bench", "examples"}
PROVIDED = {"triton_python_backend_utils"}  # Triton's python backend provides it to the models it runs


def imports(path: Path) -> set[str]:
    """Top-level names of the modules a file imports: at the top, inside functions, and import_module()."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.add(node.args[0].value.split(".")[0])
    return {name for name in found if name not in sys.stdlib_module_names and name not in OWN | PROVIDED}


def test_every_third_party_import_is_declared_where_it_runs() -> None:
    """app/ (the production image) and report/ (which runs in it) may import only [project].dependencies and the
    legacy extra's torch; the development packages (modelrepo/, devstack/, bench/, tests/, examples/) anything
    declared."""
    pyproject = read_pyproject()
    project = pyproject["project"]
    extras: dict[str, list[str]] = project["optional-dependencies"]  # type: ignore[index]
    groups: dict[str, list[str]] = pyproject["dependency-groups"]  # type: ignore[assignment]

    def names(requirements: list[str]) -> set[str]:
        return {requirement_name(r) for r in requirements if isinstance(r, str)}

    production = names(project["dependencies"])  # type: ignore[index]
    everything = production | {n for reqs in [*extras.values(), *groups.values()] for n in names(reqs)}
    distributions = importlib.metadata.packages_distributions()
    missing = []
    for folder in ("app", "report", "modelrepo", "devstack", "requirements", "bench", "tests", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT)
            allowed = everything
            if folder in ("app", "report"):
                allowed = production | names(extras["legacy"])
            for module in sorted(imports(path)):
                providers = {canonical(d) for d in distributions.get(module, [])}
                if not providers:
                    missing.append(f"{relative}: {module} (no installed package provides it)")
                elif not providers & allowed:
                    missing.append(f"{relative}: {module} ({', '.join(sorted(providers))} is not declared for it)")
    assert not missing, "declare these in pyproject.toml and run `make lock`:\n" + "\n".join(missing)
