"""Start-up as gunicorn runs it: a bad setting stops the master before any worker starts."""

from __future__ import annotations

import subprocess
import sys

from tests.support import ROOT


def test_gunicorn_refuses_to_start_with_a_bad_setting() -> None:
    result = subprocess.run([sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py"], cwd=ROOT,
                            env={"PATH": "", "SHIM_THREADS": "many"}, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "SHIM_THREADS='many' is not valid: expected a whole number" in result.stderr
    assert "Traceback" not in result.stderr
