"""Which version of the classifier an ensemble runs, against the version SHIM_MODEL_VERSION pins.

The uint8 transport sends pixels to an ensemble (resnet50_uint8: normalize -> resnet50) that has versions
of its own (1): the pin must never be sent to it. It means the classifier's version on every route, so an
ensemble honours it only when its step for the classifier names that version (`model_version: 2`); -1,
the default, runs whatever version of the classifier is newest, which the pin would not hold. Reads the
config JSON that Triton serves (GET /v2/models/<ensemble>/config); no tritonclient here.
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
