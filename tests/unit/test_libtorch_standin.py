"""The libtorch stand-in's answers to a merged batch on a CPU (modelrepo/triton_models/libtorch_standin.py): in
arrival order, in forwards of at least MIN_FORWARD_IMAGES images, each request answered when its forward ends.
The stand-in's own code runs here; only the stub's C API (tensors, responses, senders) is faked, as the stub
provides it. tests/integration/test_embedded_triton.py runs it in the real server."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from devstack.wheel import find_wheel
from tests.support import ROOT

STANDIN = ROOT / "modelrepo" / "triton_models" / "libtorch_standin.py"


class FakeTensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class FakeResponse:
    def __init__(self, output_tensors: list[FakeTensor] | None = None, error: object = None) -> None:
        self.output_tensors, self.error = output_tensors, error


class FakeRequest:
    def __init__(self, name: str, array: np.ndarray, events: list[tuple[str, Any]]) -> None:
        self.name, self.array, self.events = name, array, events

    def inputs(self) -> list[FakeTensor]:
        return [FakeTensor("input__0", self.array)]

    def get_response_sender(self) -> FakeRequest:
        return self

    def send(self, response: FakeResponse, flags: int = 0) -> None:
        self.events.append(("sent", (self.name, response, flags)))


class CountingModel:
    """Logit k of an image: its first pixel times k; each forward's batch size recorded."""

    def __init__(self, events: list[tuple[str, Any]], fail_on: int | None = None) -> None:
        self.events, self.fail_on = events, fail_on

    def __call__(self, batch: Any) -> Any:
        self.events.append(("forward", batch.shape[0]))
        if batch.shape[0] == self.fail_on:
            raise RuntimeError("out of memory")
        return batch[:, 0, 0, :1] * np.arange(3, dtype=np.float32)


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(find_wheel().python_backend))  # triton_python_backend_utils.py
    import triton_python_backend_utils as pb_utils

    for name, fake in {"Tensor": FakeTensor, "InferenceResponse": FakeResponse, "TritonError": str}.items():
        monkeypatch.setattr(pb_utils, name, fake, raising=False)
    spec = importlib.util.spec_from_file_location("libtorch_standin_under_test", STANDIN)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


class _TorchFree:
    """The stand-in hands the model torch tensors: give the counting model numpy and hand torch back."""

    def __init__(self, model: CountingModel) -> None:
        self.model = model

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(self.model(batch.numpy())))


def make_model(standin: ModuleType, events: list[tuple[str, Any]], *, gpu: bool = False,
               fail_on: int | None = None) -> Any:
    model = standin.TritonPythonModel()
    model.model = _TorchFree(CountingModel(events, fail_on))
    model.device, model.in_order = torch.device("cpu"), not gpu
    model.inputs, model.outputs, model.batched = ["input__0"], [("output__0", np.float32)], True
    return model


def requests_of(sizes: list[int], events: list[tuple[str, Any]]) -> list[FakeRequest]:
    return [FakeRequest(f"r{i}", np.full((n, 1, 1, 1), i + 1, np.float32), events) for i, n in enumerate(sizes)]


@pytest.mark.parametrize(("sizes", "chunks"), [
    ([7, 5], [[0], [1]]),                   # two shim workers' batches: each its own forward
    ([1, 1, 1, 1, 1, 1, 1, 1], [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ([2, 1, 3, 1], [[0, 1, 2, 3]]),        # 2+1+3 = 6 >= 4, and the 1 left over joins it
    ([3], [[0]]),
    ([1, 1], [[0, 1]]),
    ([4, 4, 1], [[0], [1, 2]]),
])
def test_merged_requests_are_grouped_in_order_into_forwards_of_at_least_four_images(
        standin: ModuleType, sizes: list[int], chunks: list[list[int]]) -> None:
    assert standin.MIN_FORWARD_IMAGES == 4
    assert [list(c) for c in standin.in_order_chunks(sizes, 4)] == chunks


def test_each_forwards_requests_are_answered_before_the_next_forward_runs(standin: ModuleType) -> None:
    events: list[tuple[str, Any]] = []
    requests = requests_of([7, 5], events)
    assert make_model(standin, events).execute(requests) is None  # answered through the senders
    assert [e[0] if e[0] == "sent" else e for e in events] == [("forward", 7), "sent", ("forward", 5), "sent"]
    sent = [e[1] for e in events if e[0] == "sent"]
    assert [(name, flags) for name, _, flags in sent] == [("r0", 1), ("r1", 1)]
    for (_, response, _), request in zip(sent, requests, strict=True):  # each its own rows, not the other's
        rows = response.output_tensors[0].as_numpy()
        np.testing.assert_array_equal(rows, request.array[:, 0, 0, :1] * np.arange(3, dtype=np.float32))


def test_a_gpu_instance_runs_one_forward_for_the_whole_merged_batch_as_libtorch_does(standin: ModuleType) -> None:
    events: list[tuple[str, Any]] = []
    responses = make_model(standin, events, gpu=True).execute(requests_of([7, 5], events))
    assert events == [("forward", 12)]
    assert [r.output_tensors[0].as_numpy().shape for r in responses] == [(7, 3), (5, 3)]


def test_one_request_is_answered_by_the_returned_list_as_before(standin: ModuleType) -> None:
    events: list[tuple[str, Any]] = []
    responses = make_model(standin, events).execute(requests_of([3], events))
    assert events == [("forward", 3)] and len(responses) == 1 and responses[0].error is None


def test_a_failing_forward_fails_only_its_own_requests(standin: ModuleType) -> None:
    events: list[tuple[str, Any]] = []
    make_model(standin, events, fail_on=5).execute(requests_of([7, 5], events))
    sent = {name: response for name, response, _ in (e[1] for e in events if e[0] == "sent")}
    assert sent["r0"].error is None and sent["r0"].output_tensors[0].as_numpy().shape == (7, 3)
    assert sent["r1"].output_tensors is None and "RuntimeError: out of memory" in sent["r1"].error

