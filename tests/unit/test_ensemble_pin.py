"""Which classifier version an ensemble runs, against SHIM_MODEL_VERSION (the uint8 and encoded transports are
unready when it cannot honour the pin)."""

from __future__ import annotations

from app.backends.ensemble import classifier_version, pin_problem


def test_an_ensemble_honours_a_pin_only_when_its_step_names_that_version() -> None:
    ensemble = {"ensemble_scheduling": {"step": [{"model_name": "normalize", "model_version": "-1"},
                                                 {"model_name": "resnet50", "model_version": "-1"}]}}
    assert classifier_version(ensemble, "resnet50") == -1
    assert pin_problem(ensemble, ensemble="e", classifier="resnet50", pin="") is None
    assert "runs resnet50 version -1 (the newest)" in (pin_problem(ensemble, ensemble="e", classifier="resnet50",
                                                                   pin="2") or "")
    ensemble["ensemble_scheduling"]["step"][1]["model_version"] = "2"
    assert pin_problem(ensemble, ensemble="e", classifier="resnet50", pin="2") is None
    assert "has no step for resnet18" in (pin_problem(ensemble, ensemble="e", classifier="resnet18", pin="2") or "")
