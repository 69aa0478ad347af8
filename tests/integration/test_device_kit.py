"""bench/device_check.sh --dry-run: the GPU device kit's whole measurement at toy sizes on this CPU machine,
so that it is known to work before a GPU is lent (no test depends on a GPU)."""

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
        code = run.process.wait(timeout=280)
        assert code == 0, f"device_check.sh --dry-run exited {code}:\n{run.log.read_text()[-6000:]}"
        yield json.loads((run.folder / "out" / "device_results.json").read_text())
    finally:
        run.kill()


@pytest.mark.triton
@pytest.mark.timeout(300)
def test_the_dry_run_measures_every_step(device_dry_run: dict[str, Any]) -> None:
    data = device_dry_run
    assert data["dry_run"] and not data["errors"], data["errors"]
    steps = data["steps"]
    model = steps["model_only"]
    assert set(model["in_process"]) == set(model["through_triton"]) == {"1", "2"}
    assert all(v["images_per_s"] > 0 and not v["errors"] for v in model["through_triton"].values()), model
    decode = steps["decode"]
    assert decode["decode_images_per_s"]["images_per_s"] > 0
    assert decode["encoded_ensemble_images_per_s"]["images_per_s"] > 0
    assert decode["corrupt_jpegs_refused"] == {"half": True, "no EOI": True, "minus 100 bytes": True}
    assert decode["agreement"]["met"] and decode["agreement"]["all"]["images"] == 12
    assert decode["instance_kinds"] == ["KIND_CPU"]
    rows = steps["shim"]
    assert [r["transport"] for r in rows] == ["fp32", "uint8", "encoded"]
    for r in rows:
        assert r["images_per_s"] > 0 and r["errors"] == 0, r
        assert r["shim_cpu_ms_per_image"] > 0 and r["triton_cpu_ms_per_image"] > 0, r


def test_the_kit_names_its_wheels_for_three_calls_under_64_mib() -> None:
    """The script's stages are what its header tells the lead to carry; --prepare fills them (not run here)."""
    script = (ROOT / "bench" / "device_check.sh").read_text()
    for stage in "abc":
        assert f'run(command="bash bench/device_check.sh --stage {stage}", carry=[".kit/{stage}"]' in script
        assert f"STAGE_{stage.upper()}=(" in script
    assert "nvidia-pytriton==0.7.0" in script and "numpy==1.26.4" in script
    assert ".kit/" in (ROOT / ".gitignore").read_text()
