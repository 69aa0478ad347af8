"""Start-up as gunicorn runs it: a bad setting stops the master before any worker starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.fakes import write_model_repo
from tests.support import ROOT


@pytest.mark.parametrize(("env", "message"), [
    ({"SHIM_WORKERS": "many"}, "SHIM_WORKERS='many' is not valid: expected a whole number"),
    ({"SHIM_TRITON_TIMEOUT": "5"}, "unknown setting: SHIM_TRITON_TIMEOUT (did you mean SHIM_TRITON_TIMEOUT_S"),
    ({"SHIM_THREADS": "80"}, "SHIM_THREADS is no longer a setting: derived now: SHIM_MAX_PENDING + 8"),
    ({"SHIM_MODE": "legacy", "SHIM_MODEL_REPOSITORY": "{repo}"},
     "SHIM_MODE=legacy needs the legacy backend, which cannot run here: its model file {repo}/resnet50/1/model.pt"),
    ({"SHIM_TRANSPORT": "shm"}, "SHIM_TRANSPORT=shm is gone (shared memory and auto were removed): set "
                                "SHIM_TRANSPORT=fp32"),
])
def test_gunicorn_refuses_to_start_with_a_bad_setting(env: dict[str, str], message: str, tmp_path: Path) -> None:
    repo = str(write_model_repo(tmp_path / "repo"))  # a description and labels, no legacy model file
    env = {k: v.format(repo=repo) for k, v in env.items()}
    result = subprocess.run([sys.executable, "-m", "gunicorn", "-c", "python:app.gunicorn_conf"], cwd=ROOT,
                            env={"PATH": "", **env}, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert message.format(repo=repo) in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
