"""Which version of the classifier an ensemble runs, against the version SHIM_MODEL_VERSION pins: the pin is
the classifier's, never sent to an ensemble, which honours it only when its step names that version (-1: newest).
"""

from __future__ import annotations

from typing import Any


def classifier_version(config: dict[str, Any], classifier: str) -> int | None:
    """The version of `classifier` the ensemble's step runs (-1: the newest), or None without such a step."""
    for step in config.get("ensemble_scheduling", {}).get("step", []):
        if step.get("model_name") == classifier:
            return int(step.get("model_version", -1))  # protobuf's JSON gives an int64 as a string
    return None


def pin_problem(config: dict[str, Any], *, ensemble: str, classifier: str, pin: str) -> str | None:
    """Why the ensemble cannot honour SHIM_MODEL_VERSION=`pin` (what to change), or None when it does."""
    if not pin:
        return None
    runs = classifier_version(config, classifier)
    if runs == int(pin):
        return None
    what = (f"has no step for {classifier}" if runs is None else
            f"runs {classifier} version {runs}{' (the newest)' if runs == -1 else ''}")
    return (f"SHIM_MODEL_VERSION={pin} pins {classifier} version {pin}, but the ensemble {ensemble} {what}: set "
            f"model_version: {pin} in its step for {classifier} ({ensemble}/config.pbtxt) and load it, or send "
            "tensors (SHIM_TRANSPORT=fp32), or unset SHIM_MODEL_VERSION")
