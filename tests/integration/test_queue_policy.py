"""What a description's [triton] queue policy makes Triton answer, and what the shim makes of it, on the real
server: a request over `max_queue_size` and one queued past `queue_timeout_microseconds` are refused by Triton
(docs/model-repository.md), and the shim translates them into 503 backend_unavailable and 504
backend_timeout, never into a failed batch that it would retry one request at a time."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from app.backends.triton.client import Clients
from app.errors import BackendError, BackendTimeout, BackendUnavailable
from tests.conftest import start_triton

pytestmark = pytest.mark.integration

MODEL_PY = '''
import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.4)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("y", pb_utils.get_input_tensor_by_name(r, "x")
                                                            .as_numpy())]) for r in requests]
'''
POLICIES = {  # as modelrepo/generate.py writes [triton] max_queue_size = 1 / queue_timeout_microseconds = 100000
    "bounded": "max_queue_size: 1",
    "deadline": "timeout_action: REJECT\n    default_timeout_microseconds: 100000",
}


def config(name: str, policy: str) -> str:
    return f'''name: "{name}"
backend: "python"
max_batch_size: 1
input {{ name: "x" data_type: TYPE_FP32 dims: 1 }}
output {{ name: "y" data_type: TYPE_FP32 dims: 1 }}
instance_group {{ count: 1 kind: KIND_CPU }}
dynamic_batching {{
  default_queue_policy {{
    {policy}
  }}
}}
'''


@pytest.fixture(scope="module")
def slow_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    repo = tmp_path_factory.mktemp("queue-policy-repo")
    for name, policy in POLICIES.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(MODEL_PY)
        (repo / name / "config.pbtxt").write_text(config(name, policy))
    triton = start_triton(repo, tmp_path_factory.mktemp("queue-policy-cache"))
    try:
        yield triton.http_url
    finally:
        triton.stop()


def at_once(url: str, model: str, n: int) -> list[BackendError | None]:
    """n requests to `model` at the same moment, each through the shim's own client wrapper."""
    clients = Clients(url, connect_timeout_s=5, network_timeout_s=30)
    outcomes: list[BackendError | None] = [None] * n
    start = threading.Barrier(n)

    def one(i: int) -> None:
        x = httpclient.InferInput("x", [1, 1], "FP32")
        x.set_data_from_numpy(np.ones((1, 1), dtype=np.float32), binary_data=True)
        start.wait()
        try:
            clients.call(lambda c: c.infer(model, [x]), where=f"Triton model '{model}'")
        except BackendError as e:
            outcomes[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    clients.close()
    return outcomes


def test_a_request_over_the_queue_bound_is_refused_by_triton_as_unavailable(slow_triton: str) -> None:
    outcomes = at_once(slow_triton, "bounded", 6)  # one runs, one waits, the others are over the bound
    refused = [e for e in outcomes if e is not None]
    assert len(refused) < len(outcomes), "every request was refused"
    assert refused, "Triton queued more than max_queue_size"
    assert all(type(e) is BackendUnavailable for e in refused), [(type(e).__name__, e.message) for e in refused]
    assert all("queue" in e.message.lower() for e in refused), [e.message for e in refused]


def test_a_request_queued_past_the_queue_timeout_is_refused_by_triton_as_a_timeout(slow_triton: str) -> None:
    outcomes = at_once(slow_triton, "deadline", 4)  # one runs 0.4 s; the others wait more than 0.1 s
    refused = [e for e in outcomes if e is not None]
    assert len(refused) < len(outcomes), "every request was refused"
    assert refused, "Triton kept requests queued past default_timeout_microseconds"
    assert all(type(e) is BackendTimeout for e in refused), [
        (type(e).__name__, e.message) for e in refused]


def test_the_policy_text_is_what_the_generator_writes() -> None:
    """The hand-written configs above say what modelrepo/generate.py writes for the same fields."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    from app.description import parse
    from modelrepo import generate

    for fields, name in [({"max_queue_size": 1}, "bounded"), ({"queue_timeout_microseconds": 100_000}, "deadline")]:
        d = parse({"name": "x", "model": {"torchvision": "resnet18"}, "triton": fields}, Path("/repo/x/model.toml"))
        written = text_format.Parse(generate.generated_files(d)[Path("x/config.pbtxt")], mc.ModelConfig())
        ours = text_format.Parse(config(name, POLICIES[name]), mc.ModelConfig())
        assert written.dynamic_batching.default_queue_policy == ours.dynamic_batching.default_queue_policy, name
