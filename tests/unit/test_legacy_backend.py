"""The in-process legacy backend: it loads in the background and readiness tells the truth about it."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from app.backends.legacy import LegacyBackend
from app.errors import BackendUnavailable
from tests.fakes import item
from tests.support import wait_until

SHAPE = (3, 224, 224)


def backend(path: Path) -> LegacyBackend:
    return LegacyBackend(model_path=path, threads=1, max_batch_size=8, image_shape=SHAPE, load_timeout_s=60)


def test_without_torch_readiness_says_so_and_requests_get_503(tmp_path: Path, test_model_pt: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The slim image has no torch: the load must fail visibly, not leave a model that says it is ready."""
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError, as without torch
    legacy = backend(test_model_pt)
    legacy.start()
    wait_until(lambda: "loading" not in legacy.ready().detail, 30, "the load to end")
    state = legacy.ready()
    assert not state.ready
    assert "torch is not installed" in state.detail and "WITH_LEGACY=1" in state.detail, state.detail
    with pytest.raises(BackendUnavailable, match="torch is not installed"):
        legacy.infer([item(0.0)], ["x"])


def test_a_missing_or_broken_model_file_is_not_ready_with_the_reason(tmp_path: Path) -> None:
    missing = backend(tmp_path / "nothing.pt")
    broken_path = tmp_path / "broken.pt"
    broken_path.write_bytes(b"not a torchscript archive")
    broken = backend(broken_path)
    for legacy in (missing, broken):
        legacy.start()
        wait_until(lambda b=legacy: "loading" not in b.ready().detail, 60, "the load to end")
    assert not missing.ready().ready and "does not exist; run `make export`" in missing.ready().detail
    assert not broken.ready().ready and "failed to load" in broken.ready().detail


def test_the_real_model_loads_and_answers(test_model_pt: Path) -> None:
    legacy = backend(test_model_pt)
    assert not legacy.ready().ready and "not loaded" in legacy.ready().detail  # nothing asked for it yet
    legacy.start()
    wait_until(lambda: legacy.ready().ready, 120, "the model to load")
    logits = legacy.infer([item(0.0), item(1.0)], ["a", "b"])
    assert logits.shape == (2, 1000) and logits.dtype == np.float32
