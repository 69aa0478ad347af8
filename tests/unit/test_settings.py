"""Settings come from SHIM_* variables and a bad one stops start-up, naming the variable; a retired one names
what replaced it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from app.settings import RETIRED, Mode, Settings, SettingsError

pytestmark = pytest.mark.prod  # make test-prod runs these too: numpy 2, no torch, no Triton
TYPOS_ON_PURPOSE = {"tests/unit/test_settings.py", "tests/integration/test_startup.py", "tests/unit/test_docs.py",
                    "docs/troubleshooting.md"}


def test_defaults_and_environment() -> None:
    settings = Settings.from_env({"SHIM_TRITON_URL": "triton:8000", "SHIM_BATCH_DELAY_MS": "5",
                                  "SHIM_MODE": "legacy", "SHIM_CAPTURE_DIR": "/tmp/capture"})
    assert settings.triton_host_port == "triton:8000"
    assert settings.batch_delay_ms == 5.0
    assert settings.mode is Mode.LEGACY
    assert settings.capture_dir == Path("/tmp/capture")
    assert Settings.from_env({}).mode is Mode.TRITON
    assert Settings.from_env({"SHIM_TRITON_URL": "http://triton:8000/"}).triton_host_port == "triton:8000"


def test_at_most_25_settings_each_documented_in_one_table() -> None:
    """Every setting is one a user sets, with a row in docs/settings.md; what is derived or tuned is not one."""
    from tests.support import ROOT

    names = {f"SHIM_{f.name.upper()}" for f in dataclasses.fields(Settings) if f.init}
    assert len(names) <= 25
    table = (ROOT / "docs" / "settings.md").read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in table.splitlines() if line.startswith("| `SHIM_")}
    assert rows == names


def test_the_gunicorn_threads_follow_the_admission_bound() -> None:
    assert Settings.from_env({"SHIM_MAX_PENDING": "10"}).threads > 10


@pytest.mark.parametrize(("name", "replacement"), [
    ("SHIM_BACKEND", "use SHIM_MODE"),
    ("SHIM_UINT8_MODEL", "derived now: <SHIM_MODEL_NAME>_uint8"),
    ("SHIM_LABELS_PATH", "read from the model's model.toml"),
    ("SHIM_DECODE_SLOTS", "a tuning constant now, in app/admission.py"),
    ("SHIM_ADMIN_TOKEN", "shim-traffic set"),
])
def test_a_retired_name_stops_start_up_naming_its_replacement(name: str, replacement: str) -> None:
    with pytest.raises(SettingsError, match=rf"^{name} is no longer a setting: .*{replacement}"):
        Settings.from_env({name: "1"})


def test_no_retired_name_is_a_setting_and_each_constant_it_names_exists() -> None:
    import importlib
    import re

    fields = {f"SHIM_{f.name.upper()}" for f in dataclasses.fields(Settings)}
    assert not fields & set(RETIRED)
    for why in RETIRED.values():
        for module, constant in re.findall(r"app/(\w+)\.py \((\w+)", why):
            assert hasattr(importlib.import_module(f"app.{module}"), constant), why


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
    """The export tool's, compose's and the GPU-host bench's SHIM_* names."""
    env = {"SHIM_MODEL_WEIGHTS": "/w.pth", "SHIM_MODEL_ARCH": "resnet18", "SHIM_WITH_LEGACY": "0",
           "SHIM_URL": "http://localhost:5000", "NOT_SHIM_X": "1"}
    assert Settings.from_env(env).mode is Mode.TRITON


def test_every_shim_name_the_repository_uses_is_a_setting_retired_or_allowed() -> None:
    """A new SHIM_* name in the shim, a tool, the compose file, the manifests or a test must be a setting, a
    retired name (whose message names its replacement) or one of NOT_SETTINGS; and no deployment file or
    test still sets a retired one (the shim would refuse to start)."""
    import re
    import subprocess

    from app.settings import NOT_SETTINGS
    from tests.support import ROOT

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    known = {f"SHIM_{f.name.upper()}" for f in dataclasses.fields(Settings) if f.init} | NOT_SETTINGS
    seen: set[str] = set()
    setting_retired: set[str] = set()
    for name in files:
        if name.endswith((".py", ".yml", ".yaml", ".sh", "Makefile", "Dockerfile", ".toml", ".json", ".md", "run")) \
                and name not in TYPOS_ON_PURPOSE and name != "app/settings.py":
            text = (ROOT / name).read_text(errors="replace")
            seen |= set(re.findall(r"\b(SHIM_[A-Z0-9_]*[A-Z0-9])\b", text))
            if name.endswith((".md", ".json")):  # prose: a figure measured with an old setting stays true
                continue
            setting_retired |= {f"{name}: {m}" for m in re.findall(r"\b(SHIM_[A-Z0-9_]+)(?:=|\"?:|\s*\n\s*value:)",
                                                                   text) if m in RETIRED}
    constants = {"SHIM_STAGES", "SHIM_WHEELHOUSE", "SHIM_LOCK"}  # Python names in bench/ and tools/, not variables
    assert seen - known - set(RETIRED) - constants == set()
    assert setting_retired == set()


def test_a_triton_admin_key_is_retired_and_says_why() -> None:
    with pytest.raises(SettingsError, match="SHIM_TRITON_ADMIN_KEY_FILE is no longer a setting: the shim makes no "
                                            "restricted Triton call"):
        Settings.from_env({"SHIM_TRITON_ADMIN_KEY_FILE": "/run/secrets/key"})
