"""What this image can run: the slim image (WITH_LEGACY=0) has no torch, so a mode that needs legacy
(legacy, shadow, canary, SHIM_FALLBACK) is refused at start and at every switch.

Light on purpose: gunicorn's master calls it before any worker starts. `find_spec` is injectable for tests.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from app.errors import SettingsError
from app.settings import MODES_USING_LEGACY, Settings

FindSpec = Callable[[str], object | None]


def legacy_lacks(model_path: Path, find_spec: FindSpec = importlib.util.find_spec) -> str | None:
    """What the legacy backend lacks here (named for a person), or None when it can load."""
    if find_spec("torch") is None:
        return ("torch is not installed (the image was built with WITH_LEGACY=0; build it with "
                "--build-arg WITH_LEGACY=1, or pip install '.[legacy]')")
    if not model_path.is_file():
        return f"its model file {model_path} does not exist (run `shim-export`, or fix the model.toml)"
    return None


def check_start(settings: Settings, lacks: str | None) -> None:
    """Stop start-up when the settings need the legacy backend and it cannot run here."""
    if not lacks:
        return
    if settings.mode in MODES_USING_LEGACY:
        raise SettingsError(f"SHIM_MODE={settings.mode.value} needs the legacy backend, which cannot run here: "
                            f"{lacks}; or use SHIM_MODE=triton")
    if settings.fallback:
        raise SettingsError(f"SHIM_FALLBACK=true needs the legacy backend, which cannot run here: {lacks}; "
                            "or set SHIM_FALLBACK=false")
