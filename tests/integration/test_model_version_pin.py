"""SHIM_MODEL_VERSION means the classifier's version on every route, against the real Triton serving two
versions of resnet50 (that answer differently): the pin is never sent to the uint8 ensemble, whose step
for resnet50 must name that version, else the uint8 transport is unready with what to change.

Triton serves modelrepo/standin.py's numpy models; version 2 of resnet50 answers minus version 1's logits.
`resnet50_uint8` runs resnet50 version -1 (the newest), as committed; `resnet50_uint8_v1` runs version 1.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator

import numpy as np
import pytest

from app.backends.triton import TritonBackend
from app.errors import BackendUnavailable
from app.images import Upload
from app.preprocess import ImageSpec
from devstack import EmbeddedTriton
from tests.conftest import start_triton
from tests.support import encode, photo, triton_backend

pytestmark = pytest.mark.triton
SPEC = ImageSpec()
JPEGS = [encode(photo(320, 240, seed=70 + i), "JPEG") for i in range(3)]


@pytest.fixture(scope="module")
def two_versions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedTriton]:
    from modelrepo.standin import write_standin_repo

    tmp = tmp_path_factory.mktemp("two-versions")
    repo = write_standin_repo(tmp / "triton_repo")
    model = repo / "resnet50"
    (model / "2").mkdir()
    code = (model / "1" / "model.py").read_text()
    negated = re.sub(r"^(\s+)(rows = .*)$", r"\1\2\n\1rows = -rows", code, count=1, flags=re.MULTILINE)
    assert negated != code, "modelrepo/triton_models/near_free_classifier.py changed: update this test"
    (model / "2" / "model.py").write_text(negated)
    config = model / "config.pbtxt"
    config.write_text(config.read_text() + "\nversion_policy: { all { } }\n")  # both versions served
    pinned = repo / "resnet50_uint8_v1"
    shutil.copytree(repo / "resnet50_uint8", pinned)
    text = (pinned / "config.pbtxt").read_text().replace('name: "resnet50_uint8"', 'name: "resnet50_uint8_v1"')
    step = re.compile(r'(model_name: "resnet50"\s*\n\s*model_version: )-1')
    assert step.search(text), "triton_repo/resnet50_uint8/config.pbtxt changed: update this test"
    (pinned / "config.pbtxt").write_text(step.sub(r"\g<1>1", text))
    server = start_triton(repo, tmp / "cache")
    yield server
    server.stop(graceful=False)


def backend(triton: EmbeddedTriton, transport: str, version: str, uint8_model: str = "resnet50_uint8") -> TritonBackend:
    made: TritonBackend = triton_backend(triton.http_url, transport, version=version, network_timeout_s=30,
                                         readiness_timeout_s=10, max_batch_size=8, uint8_model=uint8_model)
    return made


def items(b: TritonBackend, jpegs: list[bytes]) -> list[object]:
    return [b.prepare(Upload(data, SPEC)) for data in jpegs]


def answer(triton: EmbeddedTriton, transport: str, version: str, uint8_model: str = "resnet50_uint8") -> np.ndarray:
    b = backend(triton, transport, version, uint8_model)
    try:
        state = b.ready()
        assert state.ready, state.detail
        return np.stack(b.infer(items(b, JPEGS), [f"i{i}" for i in range(len(JPEGS))]))  # type: ignore[arg-type]
    finally:
        b.close()


def test_the_pin_sends_tensors_to_the_pinned_version(two_versions: EmbeddedTriton) -> None:
    v1, v2 = answer(two_versions, "fp32", "1"), answer(two_versions, "fp32", "2")
    assert np.abs(v1 - v2).max() > 1.0, "the two versions must answer differently"


@pytest.mark.parametrize("transport", ["uint8"])
@pytest.mark.parametrize("pin", ["1", "2"])
def test_an_ensemble_that_runs_the_newest_version_cannot_honour_a_pin_and_readiness_says_what_to_change(
        two_versions: EmbeddedTriton, transport: str, pin: str) -> None:
    b = backend(two_versions, transport, pin)
    try:
        state = b.ready()
        assert not state.ready, f"pinned {pin} but the ensemble runs the newest: {state.detail}"
        assert f"SHIM_MODEL_VERSION={pin} pins resnet50 version {pin}" in state.detail, state.detail
        assert "runs resnet50 version -1 (the newest)" in state.detail
        assert f"model_version: {pin} in its step for resnet50" in state.detail
        with pytest.raises(BackendUnavailable, match="SHIM_MODEL_VERSION"):
            b.infer(items(b, JPEGS[:1]), ["x"])
    finally:
        b.close()


def test_an_ensemble_that_names_the_pinned_version_answers_with_it(two_versions: EmbeddedTriton) -> None:
    v1 = answer(two_versions, "fp32", "1")
    np.testing.assert_allclose(answer(two_versions, "uint8", "1", "resnet50_uint8_v1"), v1, atol=1e-4)
    np.testing.assert_allclose(answer(two_versions, "uint8", "", "resnet50_uint8"), answer(two_versions, "fp32", "2"),
                               atol=1e-4)  # no pin: the newest, on every route
