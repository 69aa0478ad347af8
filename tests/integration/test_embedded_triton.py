"""The wheel's real Triton serving the repository: inference, ensemble, metrics, batching, CLI."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from devstack import EmbeddedTriton, promtext
from devstack.cpu_repo import read_config
from tests.conftest import start_early, take_early
from tests.support import ROOT, TRITON_REPO, free_ports, wait_until

pytestmark = pytest.mark.triton


def infer(client: httpclient.InferenceServerClient, model: str, name: str, array: np.ndarray,
          output: str, dtype: str = "FP32") -> np.ndarray:
    tensor = httpclient.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array, binary_data=True)
    result = client.infer(model, [tensor], outputs=[httpclient.InferRequestedOutput(output, binary_data=True)])
    return result.as_numpy(output)


def run_reference(model: object, batch: np.ndarray) -> np.ndarray:
    import torch

    with torch.inference_mode():
        return model(torch.from_numpy(batch)).numpy()  # type: ignore[operator]


def test_server_is_live_and_ready(triton_client: httpclient.InferenceServerClient) -> None:
    assert triton_client.is_server_live()
    assert triton_client.is_server_ready()
    for model in ("resnet50", "resnet50_uint8", "resnet50_encoded"):
        assert triton_client.is_model_ready(model), model


def test_resnet50_metadata_matches_its_config(triton_client: httpclient.InferenceServerClient) -> None:
    config = read_config(TRITON_REPO / "resnet50" / "config.pbtxt")
    meta = triton_client.get_model_metadata("resnet50")
    (inp,), (out,) = meta["inputs"], meta["outputs"]
    assert inp == {"name": config.input[0].name, "datatype": "FP32", "shape": [-1, *config.input[0].dims]}
    assert out == {"name": config.output[0].name, "datatype": "FP32", "shape": [-1, *config.output[0].dims]}
    served = triton_client.get_model_config("resnet50")
    assert served["max_batch_size"] == config.max_batch_size
    assert served["dynamic_batching"]["preferred_batch_size"] == list(config.dynamic_batching.preferred_batch_size)


@pytest.mark.parametrize("batch", [1, 8])
def test_infer_with_binary_tensors_equals_the_model_in_process(
        triton_client: httpclient.InferenceServerClient, reference_model: object, batch: int) -> None:
    rng = np.random.default_rng(batch)
    inputs = rng.standard_normal((batch, 3, 224, 224), dtype=np.float32)
    logits = infer(triton_client, "resnet50", "input__0", inputs, "output__0")
    assert logits.shape == (batch, 1000) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, run_reference(reference_model, inputs), rtol=0, atol=1e-4)


def test_metrics_show_that_dynamic_batching_merged_concurrent_requests(triton: EmbeddedTriton) -> None:
    before = promtext.scrape(triton.metrics_url)
    image = np.random.default_rng(0).standard_normal((1, 3, 224, 224), dtype=np.float32)

    def one(_: int) -> None:
        client = httpclient.InferenceServerClient(triton.http_url, network_timeout=60)
        try:
            for _ in range(3):
                infer(client, "resnet50", "input__0", image, "output__0")
        finally:
            client.close()

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(16)))
    after = promtext.scrape(triton.metrics_url)
    for family in ("nv_inference_request_success", "nv_inference_queue_duration_us",
                   "nv_inference_count", "nv_inference_exec_count"):
        assert any(s.matches(family, {"model": "resnet50"}) for s in after), family

    def delta(name: str) -> float:
        return promtext.total(after, name, model="resnet50") - promtext.total(before, name, model="resnet50")

    inferences, executions = delta("nv_inference_count"), delta("nv_inference_exec_count")
    assert inferences == 48
    assert executions < inferences, f"{executions} executions for {inferences} inferences: nothing was batched"


def test_requests_merged_into_one_execution_each_get_their_own_rows(
        triton: EmbeddedTriton, reference_model: object) -> None:
    """On a CPU the stand-in answers a merged batch in order, in forwards of a few images each
    (modelrepo/triton_models/libtorch_standin.py): whichever forward ran it, each request gets its own rows."""
    before = promtext.scrape(triton.metrics_url)
    rng = np.random.default_rng(29)
    batches = [rng.standard_normal((1 + i % 3, 3, 224, 224), dtype=np.float32) for i in range(12)]

    def one(batch: np.ndarray) -> np.ndarray:
        client = httpclient.InferenceServerClient(triton.http_url, network_timeout=60)
        try:
            return infer(client, "resnet50", "input__0", batch, "output__0")
        finally:
            client.close()

    with ThreadPoolExecutor(len(batches)) as pool:
        answers = list(pool.map(one, batches))
    for batch, logits in zip(batches, answers, strict=True):
        np.testing.assert_allclose(logits, run_reference(reference_model, batch), rtol=0, atol=1e-4)
    after = promtext.scrape(triton.metrics_url)
    requests = promtext.total(after, "nv_inference_request_success", model="resnet50") - \
        promtext.total(before, "nv_inference_request_success", model="resnet50")
    executions = promtext.total(after, "nv_inference_exec_count", model="resnet50") - \
        promtext.total(before, "nv_inference_exec_count", model="resnet50")
    assert requests == len(batches)
    assert executions < requests, "nothing was merged: this test did not reach the merged path"


class CliTriton:
    """`python -m devstack` on triton_repo/ as `make export` left it (what `make triton` and
    `make run` start), on free ports, its stderr in a file, its cache in a folder of its own."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="shim-cli-triton-"))
        self.stderr = self.folder / "stderr.txt"
        self.http, grpc, metrics = free_ports(3)
        self.exported = (TRITON_REPO / "resnet50" / "1" / "model.pt").is_file()
        cmd = [sys.executable, "-m", "devstack", "--model-repository", str(TRITON_REPO), "--quiet",
               f"--http-port={self.http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}",
               f"--cache-dir={self.folder / 'cache'}"]
        with self.stderr.open("wb") as err:  # a file, not a pipe: nobody reads it until the test runs
            self.process = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


# Started when collection ends (tests/conftest.py start_early): it loads while the unit tests run.
start_early("cli_triton", CliTriton)


@pytest.fixture
def cli_triton() -> Iterator[CliTriton]:
    started = take_early("cli_triton", CliTriton)
    yield started
    started.kill()


def test_cli_serves_the_exported_repository_and_stops_cleanly_on_sigint(cli_triton: CliTriton) -> None:
    """The command `make triton` / `make run` use, on triton_repo/ as `make export` left it."""
    if not cli_triton.exported:
        pytest.fail("triton_repo/resnet50/1/model.pt is missing: `make test` exports it first")
    process, client = cli_triton.process, httpclient.InferenceServerClient(f"127.0.0.1:{cli_triton.http}")

    def ready() -> bool:
        assert process.poll() is None, cli_triton.stderr.read_text()
        try:
            return bool(client.is_server_ready())
        except Exception:
            return False

    wait_until(ready, 240, "the CLI's Triton to be ready")
    assert client.is_model_ready("resnet50_uint8")
    shm = f"shim{process.pid}x*"  # the server's python-backend regions carry its launcher's pid
    assert list(Path("/dev/shm").glob(shm)), "expected the python backend's shared memory while running"
    client.close()
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) == 0
    assert "ready: HTTP" in cli_triton.stderr.read_text()
    assert not list(Path("/dev/shm").glob(shm)), "shared memory left behind after the stop"


def test_environment_of_the_stub_is_this_interpreter() -> None:
    from devstack.wheel import server_environment

    env = server_environment({"PATH": "/usr/bin", "PYTHONPATH": "/elsewhere"})
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert "PYTHONPATH" not in env


def test_a_server_that_exits_at_start_says_how_and_what_it_said_first(tmp_path: Path) -> None:
    """An unknown option: tritonserver names it in its first line, then prints 400 lines of usage, and exits 1."""
    from devstack import EmbeddedTritonConfig, EmbeddedTritonError

    (tmp_path / "repo").mkdir()
    http, grpc, metrics = free_ports(3)
    config = EmbeddedTritonConfig(model_repository=tmp_path / "repo", cache_dir=tmp_path / "cache", http_port=http,
                                  grpc_port=grpc, metrics_port=metrics, extra_args=("--no-such-option",))
    with pytest.raises(EmbeddedTritonError, match=r"exited during start-up \(exit code 1\): no error lines in its "
                                                  r"log \(first line: \S*tritonserver: unrecognized option "
                                                  r"'--no-such-option'; last: .+\); full log: "):
        EmbeddedTriton(config).start()


SLOW_MODEL_CONFIG = """name: "waits"
backend: "python"
max_batch_size: 0
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
parameters { key: "folder" value: { string_value: "%s" } }
"""
SLOW_MODEL = '''import json, pathlib, time


class TritonPythonModel:
    def initialize(self, args):  # says it is loading, then waits for the test (a minute at most)
        folder = pathlib.Path(json.loads(args["model_config"])["parameters"]["folder"]["string_value"])
        (folder / "loading").touch()
        deadline = time.monotonic() + 60
        while not (folder / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    def execute(self, requests):
        return []
'''


def test_a_server_killed_during_start_up_says_by_which_signal(tmp_path: Path) -> None:
    """SIGBUS is how the kernel stops a process that writes to a python-backend region on a full /dev/shm."""
    from devstack import EmbeddedTritonConfig, EmbeddedTritonError

    (tmp_path / "repo" / "waits" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "waits" / "config.pbtxt").write_text(SLOW_MODEL_CONFIG % tmp_path)
    (tmp_path / "repo" / "waits" / "1" / "model.py").write_text(SLOW_MODEL)
    http, grpc, metrics = free_ports(3)
    server = EmbeddedTriton(EmbeddedTritonConfig(model_repository=tmp_path / "repo", cache_dir=tmp_path / "cache",
                                                 http_port=http, grpc_port=grpc, metrics_port=metrics))
    with ThreadPoolExecutor(1) as pool:
        started = pool.submit(server.start)
        try:
            wait_until(lambda: (tmp_path / "loading").exists() or started.done(), 120, "the model to start loading")
            assert server.pid is not None
            os.kill(server.pid, signal.SIGBUS)
            with pytest.raises(EmbeddedTritonError, match=r"exited during start-up \(killed by SIGBUS, with \d+ MiB "
                                                          r"free in /dev/shm now\)"):
                started.result(timeout=60)
        finally:
            (tmp_path / "go").touch()
            server.stop(graceful=False)
