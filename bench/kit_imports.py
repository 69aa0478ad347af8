"""Whether a lent GPU machine could import what the device kit imports: its host's packages (bench/device_check.sh's
header) and the stages' wheels, nothing else. The dry run runs in the dev virtualenv, which has everything, so a
package the kit needs but no stage carries fails only on the lent machine, on first contact: tritonclient's
ml-dtypes and bench.stack's psutil did (found 12-07 by `device_check.sh --rehearse`, the lent machine's shape
made here). This check fails the dry run, which `make test` runs, on such an import.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil
import re
import sys
from pathlib import Path

# On the machine before the kit installs anything, with whatever these require (pip installed them so).
DEVICE_HOST = ("torch", "torchvision", "numpy", "pillow", "prometheus-client", "werkzeug")
OWN_PACKAGES = {"app", "bench", "devstack", "modelrepo", "report", "tests"}
NOT_THE_SHIMS = {"app.gunicorn_conf"}  # reads the settings at import: gunicorn's config, not the shim's code
# Imported when present and done without otherwise (the rehearsal ran without them): not the kit's to carry.
OPTIONAL = {"tqdm"}  # torch.hub's progress bar


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def staged(script: Path) -> set[str]:
    """The distributions the script's STAGE_A/B/C arrays pin."""
    blocks = re.findall(r"^STAGE_[ABC]=\((.*?)\)", script.read_text(), re.S | re.M)
    return {canonical(pin.split("==")[0]) for block in blocks for pin in block.split()}


def with_requirements(names: set[str]) -> set[str]:
    """`names` and everything they require unconditionally, as installed here."""
    seen: set[str] = set()
    todo = [canonical(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for requirement in requires:
            if "extra ==" not in requirement:
                todo.append(canonical(re.split(r"[ ;<>=!~\[(]", requirement, maxsplit=1)[0]))
    return seen


def import_the_shim() -> None:
    """Every module of app/, as the shim's gunicorn workers import them (the kit starts the shim in a subprocess)."""
    import app

    for info in pkgutil.walk_packages(app.__path__, "app."):
        if info.name not in NOT_THE_SHIMS:
            importlib.import_module(info.name)


def unstaged(script: Path) -> dict[str, list[str]]:
    """Top-level modules imported in this process (and the shim's) whose distributions a lent machine lacks."""
    import_the_shim()
    allowed = staged(script) | with_requirements(set(DEVICE_HOST))
    owners = importlib.metadata.packages_distributions()
    missing: dict[str, list[str]] = {}
    for module in sorted({name.partition(".")[0] for name in list(sys.modules)}):
        if module in sys.stdlib_module_names or module in OWN_PACKAGES | OPTIONAL or module not in owners:
            continue
        dists = sorted({canonical(d) for d in owners[module]})
        if not allowed.intersection(dists):
            missing[module] = dists
    return missing
