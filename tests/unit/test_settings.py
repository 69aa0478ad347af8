"""Settings come from SHIM_* variables and a bad one stops start-up, naming the variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.settings import Mode, Settings, SettingsError

pytestmark = pytest.mark.prod  # make test-prod runs these too: numpy 2, no torch, no Triton
TYPOS_ON_PURPOSE = {"tests/unit/test_settings.py", "tests/integration/test_startup.py"}


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


def test_a_rollback_error_rate_of_0_is_refused_it_would_roll_back_after_successes() -> None:
    with pytest.raises(SettingsError, match=r"SHIM_ROLLBACK_ERROR_RATE=0.0 is not valid: expected a share .* above 0"):
        Settings.from_env({"SHIM_ROLLBACK_ERROR_RATE": "0"})
    assert Settings.from_env({"SHIM_ROLLBACK_ERROR_RATE": "1"}).rollback_error_rate == 1.0
    with pytest.raises(SettingsError, match=r"SHIM_ROLLBACK_ERROR_RATE=1\.5"):
        Settings.from_env({"SHIM_ROLLBACK_ERROR_RATE": "1.5"})


@pytest.mark.parametrize(("typo", "hint"), [
    ("SHIM_TRITON_TIMEOUT", "SHIM_TRITON_TIMEOUT_S"),
    ("SHIM_MAX_PENDNG", "SHIM_MAX_PENDING"),
    ("SHIM_TRANSPRT", "SHIM_TRANSPORT"),
])
def test_an_unknown_shim_variable_stops_start_up_naming_the_closest_settings(typo: str, hint: str) -> None:
    with pytest.raises(SettingsError, match=rf"unknown setting: {typo} \(did you mean {hint}"):
        Settings.from_env({typo: "5"})
    with pytest.raises(SettingsError, match=r"unknown setting: SHIM_ZZZ;"):
        Settings.from_env({"SHIM_ZZZ": "x"})


def test_shim_names_used_outside_the_settings_are_not_typos() -> None:
    """The export tool's, compose's and the GPU-host bench's SHIM_* names, and the mode's first name."""
    env = {"SHIM_MODEL_WEIGHTS": "/w.pth", "SHIM_MODEL_ARCH": "resnet18", "SHIM_WITH_LEGACY": "0",
           "SHIM_URL": "http://localhost:5000", "SHIM_BACKEND": "triton", "NOT_SHIM_X": "1"}
    assert Settings.from_env(env).mode is Mode.TRITON


def test_every_shim_name_the_repository_sets_is_a_setting_or_allowed() -> None:
    """A new SHIM_* name in a tool, the compose file or a test must be a setting or join NOT_SETTINGS."""
    import dataclasses
    import re
    import subprocess

    from app.settings import NOT_SETTINGS
    from tests.support import ROOT

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    known = {f"SHIM_{f.name.upper()}" for f in dataclasses.fields(Settings) if f.init} | NOT_SETTINGS
    seen: set[str] = set()
    for name in files:
        if name.endswith((".py", ".yml", ".yaml", ".sh", "Makefile", "Dockerfile", ".toml", "run")) \
                and name not in TYPOS_ON_PURPOSE:
            text = (ROOT / name).read_text(errors="replace")
            seen |= set(re.findall(r"\b(SHIM_[A-Z0-9_]*[A-Z0-9])\b(?=[\"'=:}]|\s|$)", text))
    constants = {"SHIM_STAGES", "SHIM_WHEELHOUSE", "SHIM_LOCK"}  # Python names in bench/ and tools/, not variables
    assert seen - known - constants == set()


def test_the_admin_key_comes_from_a_file_and_is_never_shown(tmp_path: Path) -> None:
    secret = tmp_path / "triton-admin-key"
    secret.write_text("0123456789abcdef0123\n")
    settings = Settings.from_env({"SHIM_TRITON_ADMIN_KEY_FILE": str(secret)})
    assert settings.triton_admin_headers == {"triton-admin-key": "0123456789abcdef0123"}
    direct = Settings.from_env({"SHIM_TRITON_ADMIN_KEY": "fedcba9876543210", "SHIM_TRITON_ADMIN_HEADER": "x-key"})
    assert direct.triton_admin_headers == {"x-key": "fedcba9876543210"}
    assert "0123456789abcdef" not in repr(settings) and "fedcba98" not in repr(direct)
    assert Settings.from_env({}).triton_admin_headers == {}


@pytest.mark.parametrize(("content", "message"), [
    (None, r"SHIM_TRITON_ADMIN_KEY_FILE='.*' cannot be read \(No such file or directory\)"),
    ("  \n", r"SHIM_TRITON_ADMIN_KEY_FILE='.*' is empty"),
    ("short", r"SHIM_TRITON_ADMIN_KEY_FILE='<hidden>' is not valid: expected at least 16 characters"),
])
def test_a_missing_empty_or_weak_key_file_stops_start_up_and_says_so(tmp_path: Path, content: str | None,
                                                                     message: str) -> None:
    secret = tmp_path / "key"
    if content is not None:
        secret.write_text(content)
    with pytest.raises(SettingsError, match=message):
        Settings.from_env({"SHIM_TRITON_ADMIN_KEY_FILE": str(secret)})
    with pytest.raises(SettingsError, match="both set"):
        Settings.from_env({"SHIM_TRITON_ADMIN_KEY_FILE": str(secret), "SHIM_TRITON_ADMIN_KEY": "k" * 20})
