"""The one Prometheus text reader and the one way to wait for a condition."""

from __future__ import annotations

import pytest

from devstack import promtext
from devstack.waiting import WaitTimeout, wait_until

pytestmark = pytest.mark.prod  # make test-prod runs these too: numpy 2, no torch, no Triton

TEXT = '''# HELP nv_inference_count Number of inferences performed
# TYPE nv_inference_count counter
nv_inference_count{model="resnet50",version="1"} 48
nv_inference_count{model="preprocess",version="1"} 2
shim_requests_total{backend="triton",mode="triton",status="200"} 3.0
odd{path="a \\"quoted\\" \\\\ value",other="x"} 1e3 1700000000000
'''


def test_samples_keep_their_names_labels_and_values() -> None:
    samples = promtext.parse(TEXT)
    assert [s.name for s in samples] == ["nv_inference_count", "nv_inference_count", "shim_requests_total", "odd"]
    assert promtext.total(samples, "nv_inference_count") == 50  # no _total renaming of Triton's counters
    assert promtext.total(samples, "nv_inference_count", model="resnet50") == 48
    assert promtext.maximum(samples, "shim_requests_total", status="200") == 3
    assert samples[-1].labels == {"path": 'a "quoted" \\ value', "other": "x"} and samples[-1].value == 1000
    assert promtext.label_names(samples)["shim_requests_total"] == {"backend", "mode", "status"}


def test_waiting_ends_when_the_condition_holds_times_out_or_gives_up() -> None:
    seen = []
    wait_until(lambda: seen.append(1) or len(seen) >= 3, 10, "three polls", interval_s=0.001)
    assert len(seen) == 3
    with pytest.raises(WaitTimeout, match=r"timed out after 0\.05 s waiting for never"):
        wait_until(lambda: False, 0.05, "never", interval_s=0.01)
    with pytest.raises(WaitTimeout, match="stopped waiting for the server: it exited"):
        wait_until(lambda: False, 60, "the server", give_up=lambda: "it exited")
