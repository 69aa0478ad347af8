"""`shim-serve`: the shim under gunicorn with its own configuration (app/gunicorn_conf.py)."""

from __future__ import annotations

import os
import sys


def main() -> None:
    """Replace this process with gunicorn: signals (SIGTERM, SIGHUP) reach the master directly."""
    os.execv(sys.executable, [sys.executable, "-m", "gunicorn", "-c", "python:app.gunicorn_conf", *sys.argv[1:]])
