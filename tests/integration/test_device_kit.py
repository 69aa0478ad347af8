"""bench/device_check.sh --dry-run: the GPU device kit's whole run less the GPU, from a copy of the work tree as a
lent machine receives it, so that it is known to work before a GPU is lent (no test depends on a GPU)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import start_early, take_early
from tests.support import ROOT


class DryRun:
    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="shim-device-dry-"))
        self.log = self.folder / "kit.log"
        self.started = time.monotonic()
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(["bash", "bench/device_check.sh", "--dry-run", str(self.folder / "out")],
                                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            env={**os.environ, "PYTHON": sys.executable})

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, 15)
            self.process.wait(timeout=60)
        shutil.rmtree(self.folder, ignore_errors=True)


start_early("device_dry_run", DryRun)


@pytest.fixture(scope="module")
def device_dry_run() -> Iterator[dict[str, Any]]:
    run = take_early("device_dry_run", DryRun)
    try:
        code = run.process.wait(timeout=420)
        assert code == 0, f"device_check.sh --dry-run exited {code}:\n{run.log.read_text()[-6000:]}"
        yield json.loads((run.folder / "out" / "device_results.json").read_text())
    finally:
        run.kill()


@pytest.mark.triton
@pytest.mark.timeout(440)
def test_the_dry_run_writes_every_section_with_the_gpu_plans_shapes(device_dry_run: dict[str, Any]) -> None:
    from bench import corpus
    from bench.device_kit import BATCHES, DRY, SECTIONS

    data = device_dry_run
    assert data["dry_run"] and not data["errors"], data["errors"]
    assert Path(data["tree"]) != ROOT and not Path(data["tree"]).is_relative_to(ROOT)  # it ran from a copy
    steps = data["steps"]
    assert set(SECTIONS) <= set(steps), sorted(steps)
    assert steps["libraries"]["not_found"] == {} and len(steps["libraries"]["checked"]) >= 3
    assert int(steps["python_env"]["numpy"].split(".")[0]) < 2 and steps["python_env"]["torch"]
    smoke = steps["smoke"]
    assert smoke["in_process"] == {"device": "cpu", "dtype": "torch.float32", "shape": [1, 3, 224, 224],
                                   "decoded_on": "host"}
    assert smoke["through_triton"]["shape"] == [1, 3, 224, 224] and smoke["through_triton"]["max_levels"] <= 1
    assert smoke["answer"]["top1_encoded"] == smoke["answer"]["top1_cpu_path"]
    model = steps["model_only"]
    assert set(model["in_process"]) == set(model["through_triton"]) == {str(b) for b in BATCHES}
    assert all(v["images_per_s"] > 0 and not v["errors"] for v in model["through_triton"].values()), model
    decode = steps["decode"]
    assert decode["decode_images_per_s"]["images_per_s"] > 0
    assert decode["encoded_ensemble_images_per_s"]["images_per_s"] > 0
    assert decode["corrupt_jpegs_refused"] == {"half": True, "no EOI": True, "minus 100 bytes": True}
    assert decode["agreement"]["met"] and decode["agreement"]["all"]["images"] == len(corpus.plan())
    assert decode["instance_kinds"] == ["KIND_CPU"]
    # measured in the order a call cut short by the device's time limit loses least: the shim, encoded first
    assert [name for name in data["seconds"] if name in SECTIONS] == list(SECTIONS)
    rows = steps["shim"]
    assert [(r["transport"], r["connections"]) for r in rows] == [(t, c) for t in ("encoded", "fp32", "uint8")
                                                                 for c in DRY.connections]
    for r in rows:
        assert r["images_per_s"] > 0 and r["errors"] == 0, r
        assert r["shim_cpu_ms_per_image"] > 0 and r["triton_cpu_ms_per_image"] > 0, r


def received_tree(dest: Path) -> Path:
    """triton_repo as a lent machine receives it: git's tracked and unignored files, no export."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "triton_repo"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for rel in listed:
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / rel, dest / rel)
    return dest


@pytest.mark.timeout(240)
def test_the_kit_generates_the_repository_and_refuses_one_edited_behind_its_description(tmp_path: Path) -> None:
    from bench.device_kit import BENCH, DESCRIBED, DRY, build_repo, check_repo
    from devstack.cpu_repo import read_config
    from devstack.errors import EmbeddedTritonError

    tree = received_tree(tmp_path / "tree")
    assert not (tree / "triton_repo" / "resnet50_decode" / "1" / "model.py").exists()  # ignored: never carried
    with pytest.raises(EmbeddedTritonError, match=r"model\.p[ty] is missing"):  # no export, no generated file
        check_repo(tree / "triton_repo")
    repo = build_repo(tmp_path / "repo", DRY, root=tree)
    assert (repo / "resnet50_decode" / "1" / "model.py").is_file()
    assert read_config(repo / DESCRIBED / "config.pbtxt").max_batch_size == 32  # as its description says
    assert read_config(repo / BENCH / "config.pbtxt").max_batch_size == 64  # the kit's own model for batch 64
    config = repo / DESCRIBED / "config.pbtxt"
    original = config.read_text()
    config.write_text(original.replace("max_batch_size: 32", "max_batch_size: 64"))
    with pytest.raises(EmbeddedTritonError, match=r"older than resnet50/model\.toml: max_batch_size 64"):
        check_repo(repo)
    config.write_text(original)
    (repo / "resnet50_decode" / "1" / "model.py").unlink()
    with pytest.raises(EmbeddedTritonError, match=r"model\.py is missing"):
        check_repo(repo)


def test_the_kit_names_its_wheels_for_three_calls_under_64_mib() -> None:
    """The script's stages are what its header tells the lead to carry; --prepare fills them (not run here)."""
    script = (ROOT / "bench" / "device_check.sh").read_text()
    for stage in "abc":
        assert f'run(command="bash bench/device_check.sh --stage {stage}", carry=[".kit/{stage}"]' in script
        assert f"STAGE_{stage.upper()}=(" in script
    assert "nvidia-pytriton==0.7.0" in script and "numpy==1.26.4" in script
    assert "git ls-files -z --cached --others --exclude-standard" in script  # the dry run's tree
    assert ".kit/" in (ROOT / ".gitignore").read_text()
