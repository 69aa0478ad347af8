"""requirements/lock.py and the lock files it wrote: `make install`'s check, the chaining of requirements/*.txt."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from requirements import lock
from requirements.lock import LOCKS, Pin, cuda_only, differences, inputs, python_problem, read_pins, read_pyproject
from tests.support import ROOT

pytestmark = pytest.mark.prod  # make test-prod runs these too: numpy 2, no torch, no Triton

LOCK_DIR = ROOT / "requirements"


def versions(name: str) -> dict[str, str]:
    """{package: version} of requirements/<name>.txt (a package pinned twice, per Python, keeps both)."""
    out: dict[str, str] = {}
    for pin in read_pins(LOCK_DIR / f"{name}.txt"):
        version = pin.line.split("==")[1].split(";")[0].strip()
        out[pin.name] = f"{out[pin.name]}|{version}" if pin.name in out else version
    return out


def test_the_committed_locks_were_made_from_this_pyproject() -> None:
    """What `make install` checks first: run `make lock` after changing pyproject.toml's requirements."""
    recorded = json.loads((LOCK_DIR / "inputs.json").read_text())
    assert differences(recorded, inputs(read_pyproject())) == [], "pyproject.toml changed: run `make lock`"


def test_a_changed_pyproject_is_named_requirement_by_requirement() -> None:
    before = inputs(read_pyproject())
    pyproject: dict[str, Any] = copy.deepcopy(read_pyproject())
    pyproject["project"]["dependencies"] = [r.replace("mmh3>=4,<6", "mmh3>=4.1,<6") if r.startswith("mmh3") else r
                                            for r in pyproject["project"]["dependencies"]]
    pyproject["project"]["optional-dependencies"]["dev"].append("nvidia-nvimgcodec-cu12>=0.9")
    pyproject["project"]["optional-dependencies"]["legacy"].remove("torchvision==0.29.1")
    assert differences(before, inputs(pyproject)) == [
        "dependencies: 'mmh3>=4,<6' -> 'mmh3>=4.1,<6'",
        "optional-dependencies.dev: added 'nvidia-nvimgcodec-cu12>=0.9'",
        "optional-dependencies.legacy: removed 'torchvision==0.29.1'",
    ]


def test_check_refuses_a_stale_lock_with_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "inputs.json"
    recorded = json.loads((LOCK_DIR / "inputs.json").read_text())
    recorded["dependencies"] = [r for r in recorded["dependencies"] if not r.startswith("mmh3")]
    stale.write_text(json.dumps(recorded))
    monkeypatch.setattr(lock, "INPUTS", stale)
    assert lock.check("prod") == 1
    err = capsys.readouterr().err
    assert "dependencies: added 'mmh3>=4,<6'" in err and "Run `make lock`" in err


def test_which_pythons_run_which_environment() -> None:
    pyproject = read_pyproject()
    assert [v for v in [(3, m) for m in range(9, 16)] if python_problem("prod", pyproject, v) is None] == [
        (3, 11), (3, 12), (3, 13)]
    assert [v for v in [(3, m) for m in range(9, 16)] if python_problem("dev", pyproject, v) is None] == [
        (3, 11), (3, 12)]
    why = python_problem("dev", pyproject, (3, 13))
    assert why is not None and "numpy<2" in why and "make test PYTHON=python3.11" in why
    assert "3.11 or 3.12 or 3.13" in (python_problem("prod", pyproject, (3, 10)) or "")


def test_every_pin_has_hashes_and_every_lock_its_header() -> None:
    for spec in LOCKS:
        text = spec.path.read_text()
        assert text.startswith(f"# requirements/{spec.name}.txt: "), spec.name
        blocks = [b for b in text.split("\n") if b and not b[0].isspace() and not b.startswith("#")]
        assert blocks, spec.name
        for requirement in blocks:
            after = text[text.index(requirement) + len(requirement):].split("\n", 2)[1]
            assert "--hash=sha256:" in after, f"{spec.name}: {requirement} has no hash"


def test_one_version_of_each_package_everywhere_but_numpy() -> None:
    """The image (shim) is what make test-prod runs (prod-test); the dev environment runs the shim's direct
    dependencies at the same versions, with numpy 1.26 (nvidia-pytriton's numpy<2) where the image has 2."""
    shim, dev, prod_test, legacy = versions("shim"), versions("dev"), versions("prod-test"), versions("shim-legacy")
    assert {k: v for k, v in prod_test.items() if k in shim} == shim
    assert {k: v for k, v in legacy.items() if k in shim} == shim
    direct = {"flask", "werkzeug", "gunicorn", "tritonclient", "pillow", "prometheus-client", "mmh3"}
    assert {k: dev[k] for k in direct} == {k: shim[k] for k in direct}
    assert shim["numpy"].startswith("2.") and dev["numpy"].startswith("1.26.")
    assert {"torch", "torchvision", "nvidia-pytriton", "grpcio", "protobuf"}.isdisjoint(shim)
    assert {k: v for k, v in versions("ci-triton").items() if k in dev} == {
        k: dev[k] for k in versions("ci-triton") if k in dev}


def test_the_legacy_image_gets_torchs_cpu_build_and_none_of_the_cuda_runtime() -> None:
    legacy = versions("shim-legacy")
    assert not [name for name in legacy if lock.CUDA_NAMES.match(name)] and "torch" not in legacy
    assert {"sympy", "networkx", "filelock", "jinja2", "fsspec"} <= set(legacy)  # torch's own dependencies
    pinned = {line.split("==")[0]: line.split("==")[1] for line in (LOCK_DIR / "torch-cpu.txt").read_text().split()
              if "==" in line}
    legacy_extra = dict(r.split("==") for r in read_pyproject()["project"]["optional-dependencies"]["legacy"])
    assert pinned == {name: f"{version}+cpu" for name, version in legacy_extra.items()}


def test_cuda_only_takes_what_only_torchs_cuda_build_needs() -> None:
    pins = [Pin("torch", "torch==2", frozenset({"(project)"})),
            Pin("nvidia-cublas", "nvidia-cublas==1", frozenset({"torch"})),
            Pin("cuda-bindings", "cuda-bindings==1", frozenset({"cuda-toolkit"})),
            Pin("cuda-toolkit", "cuda-toolkit==1", frozenset({"torch"})),
            Pin("cuda-pathfinder", "cuda-pathfinder==1", frozenset({"cuda-bindings", "nvidia-cublas"})),
            Pin("nvidia-nvimgcodec-cu12", "nvidia-nvimgcodec-cu12==1", frozenset({"(project)"})),
            Pin("numpy", "numpy==1", frozenset({"torch", "(project)", "nvidia-cublas"})),
            Pin("filelock", "filelock==1", frozenset({"torch"}))]
    assert cuda_only(pins) == {"nvidia-cublas", "cuda-toolkit", "cuda-bindings", "cuda-pathfinder"}


def test_read_pins_reads_uvs_annotations(tmp_path: Path) -> None:
    path = tmp_path / "x.txt"
    path.write_text("# header\n"
                    "flask==3.1.3 \\\n    --hash=sha256:aa\n    # via flask-triton-shim (pyproject.toml)\n"
                    "numpy==2.4.6 ; python_full_version < '3.15' \\\n    --hash=sha256:bb \\\n    --hash=sha256:cc\n"
                    "    # via\n    #   -c requirements/shim.txt\n    #   flask-triton-shim (pyproject.toml)\n"
                    "    #   ml-dtypes\n")
    assert read_pins(path) == [Pin("flask", "flask==3.1.3", frozenset({"(project)"})),
                               Pin("numpy", "numpy==2.4.6 ; python_full_version < '3.15'",
                                   frozenset({"(project)", "ml-dtypes"}))]
