"""The encoded transport's agreement gate on the generated corpus, against the real Triton's decode step
(its CPU copy): the figures docs/transports.md states, measured on every `make test` (python -m bench.agreement),
with the model the other tests serve (EfficientNet-Lite0, modelrepo/export.py's export) and its own preprocessing."""

from __future__ import annotations

import pytest

from bench import agreement, corpus, reference_model
from devstack import EmbeddedTriton

pytestmark = pytest.mark.triton


def test_the_cpu_copy_agrees_with_the_legacy_path_on_the_whole_corpus(triton: EmbeddedTriton) -> None:
    items = corpus.cached()
    assert len(items) >= 200
    assert {i.kind for i in items} == set(corpus.KINDS)
    assert min(i.width * i.height for i in items) == 1 and max(max(i.width, i.height) for i in items) == 4000
    description = reference_model.reference()  # the session's repository has its decode step (tests/conftest.py)
    assert (description.resize, description.mean) == (224, (127 / 255,) * 3)  # its own, not resnet50's
    step = agreement.DecodeStep(triton.http_url, description.decode_model)
    try:
        rows, summary = agreement.measure(items, step, description)
    finally:
        step.close()
    assert summary["met"], agreement.markdown(rows, summary, "the session's Triton")
    assert summary["all"]["top1_agreement"] >= agreement.TOP1_TARGET
    assert summary["all"]["top5_overlap"] >= agreement.TOP5_TARGET
    forwarded = [r for r in rows if r.path == "triton"]
    assert {r.kind for r in forwarded} == {k for k in corpus.JPEG_KINDS if k != "jpeg cmyk"}
    assert max(r.max_levels for r in forwarded) <= 1.0 + 1e-3  # libjpeg-turbo's pixels; the resize within 1
    assert all(r.max_levels == 0 for r in rows if r.path != "triton")  # the shim's own CPU path: legacy's code
    assert {r.path for r in rows if r.kind == "jpeg cmyk"} == {"jpeg_mode"}
