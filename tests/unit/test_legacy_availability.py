"""On an image without torch (the slim production image) a mode that needs the legacy backend is refused up
front, naming what is missing: at start, by shim-traffic, and in the flag file."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from app import create_app
from app.capabilities import legacy_lacks
from app.settings import Mode, Settings, SettingsError
from app.traffic import main as shim_traffic
from tests.fakes import EchoBackend, write_model_repo

NO_TORCH = "torch is not installed (the image was built with WITH_LEGACY=0)"


def slim_app(tmp_path: Path, **settings: Any) -> Any:
    legacy = EchoBackend("legacy")
    legacy.lacks = NO_TORCH
    values = {"model_repository": write_model_repo(tmp_path / "repo"), "flag_file": tmp_path / "traffic.json",
              **settings}
    return create_app(Settings(**values), backends={"triton": EchoBackend("triton"), "legacy": legacy})


def test_the_check_names_torch_or_the_model_file(tmp_path: Path) -> None:
    model = tmp_path / "model.pt"
    assert "torch is not installed" in (legacy_lacks(model, find_spec=lambda name: None) or "")
    assert f"{model} does not exist" in (legacy_lacks(model, find_spec=lambda name: object()) or "")
    model.write_bytes(b"torchscript")
    assert legacy_lacks(model, find_spec=lambda name: object()) is None


@pytest.mark.parametrize("change", [["legacy"], ["shadow"], ["canary", "--canary-percent", "10"]])
def test_shim_traffic_refuses_a_mode_that_needs_legacy_naming_what_is_missing(
        tmp_path: Path, change: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Here the legacy model file is missing (the repository has no export): the switch is refused, the file kept."""
    import app.capabilities

    real = app.capabilities.legacy_lacks
    monkeypatch.setattr("app.capabilities.legacy_lacks", lambda path: real(path, find_spec=lambda name: object()))
    monkeypatch.setenv("SHIM_MODEL_REPOSITORY", str(write_model_repo(tmp_path / "repo")))
    flag = tmp_path / "traffic.json"
    assert shim_traffic(["--flag-file", str(flag), "set", *change]) == 2
    err = capsys.readouterr().err
    assert f"mode {change[0]} needs the legacy backend" in err and "model.pt does not exist" in err
    assert not flag.exists()
    assert shim_traffic(["--flag-file", str(flag), "set", "triton", "--reason", "ok"]) == 0
    assert json.loads(flag.read_text())["reason"] == "ok"


def test_a_flag_file_asking_for_legacy_is_reported_and_the_last_good_state_kept(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "traffic.json").write_text(json.dumps({"mode": "shadow"}))
    with caplog.at_level(logging.ERROR, logger="app.traffic"):
        app = slim_app(tmp_path)
        view = app.test_client().get("/traffic").json
    try:
        assert view["mode"] == "triton" and view["source"] == "env"
        assert "needs the legacy backend" in view["flag_file_error"] and "torch" in view["flag_file_error"]
        assert any("torch is not installed" in r.getMessage() for r in caplog.records)
        assert app.test_client().get("/readyz").status_code == 200  # Triton answers: ready, as before
    finally:
        app.extensions["shim"].close()


@pytest.mark.parametrize(("settings", "message"), [
    ({"mode": Mode.LEGACY}, r"SHIM_MODE=legacy needs the legacy backend, which cannot run here: torch is not"),
    ({"mode": Mode.CANARY}, r"SHIM_MODE=canary needs the legacy backend"),
    ({"fallback": True}, r"SHIM_FALLBACK=true needs the legacy backend"),
])
def test_settings_that_need_legacy_stop_start_up_on_an_image_without_it(tmp_path: Path, settings: dict[str, Any],
                                                                        message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        slim_app(tmp_path, **settings)
