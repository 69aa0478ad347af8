"""The layers above the Triton backend never know which transport runs: one class per transport below the
seam (app/backends/triton/), chosen once at start."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from app.backends.triton import TRANSPORTS
from app.settings import Settings, SettingsError

APP = Path(__file__).resolve().parents[2] / "app"
ABOVE_THE_SEAM = ("service.py", "routing.py", "batching.py", "shadow.py")
# Every transport's name, the ones removed too, and the names of what they send.
NAMES = re.compile(r"\b(fp32|uint8|encoded|forwarded|shm|shared memory|auto)\b", re.IGNORECASE)


@pytest.mark.parametrize("module", ABOVE_THE_SEAM)
def test_the_service_router_batcher_and_shadow_runner_name_no_transport(module: str) -> None:
    source = (APP / module).read_text()
    found = sorted({m.group(0) for m in NAMES.finditer(source)})
    assert found == [], f"app/{module} names {found}"
    assert "sniff" not in source and "tritonclient" not in source


def test_each_transport_is_a_class_chosen_from_the_setting() -> None:
    assert sorted(TRANSPORTS) == ["encoded", "fp32", "uint8"]
    assert Settings().transport == "fp32"


@pytest.mark.parametrize(("gone", "instead"), [("http", "fp32"), ("shm", "fp32"), ("uint8-shm", "uint8"),
                                                ("auto", "fp32")])
def test_a_removed_transport_stops_the_start_naming_its_replacement(gone: str, instead: str) -> None:
    with pytest.raises(SettingsError, match=rf"SHIM_TRANSPORT={gone} is gone .*: set SHIM_TRANSPORT={instead}$"):
        Settings(transport=gone)
