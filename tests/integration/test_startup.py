"""Start-up as gunicorn runs it: a bad setting stops the master before any worker starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import ROOT


@pytest.mark.parametrize(("env", "message"), [
    ({"SHIM_THREADS": "many"}, "SHIM_THREADS='many' is not valid: expected a whole number"),
    ({"SHIM_TRITON_TIMEOUT": "5"}, "unknown setting: SHIM_TRITON_TIMEOUT (did you mean SHIM_TRITON_TIMEOUT_S"),
    ({"SHIM_MODE": "legacy", "SHIM_LEGACY_MODEL_PATH": "/nonexistent/model.pt"},
     "SHIM_MODE=legacy needs the legacy backend, which cannot run here: its model file /nonexistent/model.pt"),
    ({"SHIM_TRITON_ADMIN_KEY_FILE": "/nonexistent/key"},
     "SHIM_TRITON_ADMIN_KEY_FILE='/nonexistent/key' cannot be read"),
])
def test_gunicorn_refuses_to_start_with_a_bad_setting(env: dict[str, str], message: str) -> None:
    result = subprocess.run([sys.executable, "-m", "gunicorn", "-c", "python:app.gunicorn_conf"], cwd=ROOT,
                            env={"PATH": "", **env}, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
