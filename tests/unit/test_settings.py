"""Settings come from SHIM_* variables and a bad one stops start-up, naming the variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.settings import Mode, Settings, SettingsError


def test_defaults_and_environment() -> None:
    settings = Settings.from_env({"SHIM_TRITON_URL": "triton:8000", "SHIM_BATCH_DELAY_MS": "5",
                                  "SHIM_MODE": "legacy", "SHIM_LABELS_PATH": "/tmp/labels.txt"})
    assert settings.triton_host_port == "triton:8000"
    assert settings.batch_delay_ms == 5.0
    assert settings.mode is Mode.LEGACY
    assert settings.labels_path == Path("/tmp/labels.txt")
    assert Settings.from_env({}).mode is Mode.TRITON
    assert Settings.from_env({"SHIM_TRITON_URL": "http://triton:8000/"}).triton_host_port == "triton:8000"


def test_shim_backend_is_accepted_as_the_first_name_of_the_mode() -> None:
    assert Settings.from_env({"SHIM_BACKEND": "legacy"}).mode is Mode.LEGACY


@pytest.mark.parametrize(("env", "message"), [
    ({"SHIM_BATCH_DELAY_MS": "soon"}, r"SHIM_BATCH_DELAY_MS='soon' is not valid: expected a number"),
    ({"SHIM_WORKERS": "0"}, r"SHIM_WORKERS=0 is not valid: expected a whole number from 1 to 256"),
    ({"SHIM_MODE": "blue"}, r"SHIM_MODE='blue' is not valid: expected legacy \| triton \| shadow \| canary"),
    ({"SHIM_TRITON_URL": "triton:8000/v2"}, r"SHIM_TRITON_URL='triton:8000/v2' is not valid: expected host:port"),
    ({"SHIM_TRITON_TIMEOUT_S": "-1"}, r"SHIM_TRITON_TIMEOUT_S=-1.0 is not valid"),
    ({"SHIM_MODEL_VERSION": "latest"}, r"SHIM_MODEL_VERSION='latest' is not valid"),
    ({"SHIM_PROXY_LOG_ADDRESS": "5140"}, r"SHIM_PROXY_LOG_ADDRESS='5140' is not valid: expected empty \(off\) or "
                                         r"host:port"),
    ({"SHIM_PROXY_LOG_ADDRESS": "127.0.0.1:99999"}, r"SHIM_PROXY_LOG_ADDRESS='127.0.0.1:99999' is not valid"),
])
def test_a_bad_value_names_the_variable_and_what_it_allows(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_env(env)
