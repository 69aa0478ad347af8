"""The wheel's Triton (2.51, = NGC 24.10) runs a numpy-only python-backend model right with numpy 1.26 and fails
every request with numpy 2: why requirements/triton-image.txt pins numpy<2 (docs/gpu.md, "The Triton image").

The same model (y = x * 2) is served by .venv's tritonserver twice, side by side: once with the python backend's
stub and packages taken from .venv (numpy 1.26, the dev Python), once from this environment (.venv-prod: numpy
2, make test-prod's Python), each chosen as devstack/wheel.py chooses them for the interpreter that runs the
models. The server is started here, not through devstack.server, which needs protobuf (absent from .venv-prod).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import urllib3

from devstack.launch import free_port
from devstack.waiting import wait_for_http
from devstack.wheel import TritonWheel
from tests.support import ROOT

pytestmark = [pytest.mark.prod, pytest.mark.integration]

DEV_PYTHON = ROOT / ".venv" / "bin" / "python"
# Triton's python backend (pybind11 2.10) reads a numpy 2 output array's size wrongly (python_backend #384, r24.11).
NUMPY2_FAILURE = "output tensor shape does not match size of output for 'y'"
X = np.arange(1, 7, dtype=np.float32).reshape(2, 3)  # a batch of two rows

MODEL_PY = '''
import json, sys
from pathlib import Path
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):  # what the stub really imported, for the test to check
        seen = {"numpy": np.__version__, "python": list(sys.version_info[:2]), "prefix": sys.prefix}
        (Path(args["model_repository"]) / "seen.json").write_text(json.dumps(seen))

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("y", pb_utils.get_input_tensor_by_name(r, "x")
                                                            .as_numpy() * 2)]) for r in requests]
'''
CONFIG = '''name: "double"
backend: "python"
max_batch_size: 8
input [{ name: "x", data_type: TYPE_FP32, dims: [3] }]
output [{ name: "y", data_type: TYPE_FP32, dims: [3] }]
instance_group [{ kind: KIND_CPU, count: 1 }]
'''


def models_environment(python: Path) -> tuple[tuple[int, int], dict[str, str], Path]:
    """For an interpreter: its version (whose stub runs the models), the server's environment that makes the stub
    use its packages (devstack.wheel.server_environment, run by it), and .venv's tritonserver wheel."""
    if not python.exists():
        raise AssertionError(f"{python} is missing: make test-prod needs the dev environment (make install)")
    code = ("import json, pathlib, importlib.util; from devstack.wheel import running_python, server_environment\n"
            "spec = importlib.util.find_spec('pytriton')\n"
            "wheel = str(pathlib.Path(next(iter(spec.submodule_search_locations))) / 'tritonserver') if spec else ''\n"
            "print(json.dumps([running_python(), server_environment(), wheel]))")
    out = subprocess.run([str(python), "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    version, env, wheel = json.loads(out.stdout)
    return (version[0], version[1]), env, Path(wheel)


class Served:
    def __init__(self, python: Path, wheel_root: Path, work: Path) -> None:
        version, env, _ = models_environment(python)
        self.repo, self.log_path = work / "repo", work / "triton.log"
        (self.repo / "double" / "1").mkdir(parents=True)
        (self.repo / "double" / "config.pbtxt").write_text(CONFIG)
        (self.repo / "double" / "1" / "model.py").write_text(MODEL_PY)
        wheel = TritonWheel(root=wheel_root, python=version)
        wheel.check()
        self.shm_prefix = f"numpy{os.getpid()}x{uuid.uuid4().hex[:6]}_"
        http, grpc, metrics = (free_port() for _ in range(3))
        self.url = f"http://127.0.0.1:{http}"
        cmd = [str(wheel.binary), f"--model-repository={self.repo}",
               f"--backend-directory={wheel.backend_directory(work / 'backends')}",
               "--http-address=127.0.0.1", f"--http-port={http}", "--grpc-address=127.0.0.1", f"--grpc-port={grpc}",
               "--metrics-address=127.0.0.1", f"--metrics-port={metrics}", "--allow-gpu-metrics=false",
               "--pinned-memory-pool-byte-size=0", "--exit-timeout-secs=3",
               f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}"]
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def wait_ready(self) -> None:
        wait_for_http(self.url + "/v2/health/ready", 60, what="tritonserver to be ready",
                      give_up=lambda: None if self.process.poll() is None else f"it exited:\n{self.log()}")

    def seen(self) -> dict[str, object]:
        """What model.py's initialize found: numpy's version, Python's, sys.prefix."""
        return dict(json.loads((self.repo / "double" / "seen.json").read_text()))  # model_repository: its folder

    def infer(self) -> tuple[int, dict[str, Any]]:
        body = {"inputs": [{"name": "x", "shape": list(X.shape), "datatype": "FP32", "data": X.ravel().tolist()}]}
        answer = urllib3.request("POST", f"{self.url}/v2/models/double/infer", json=body, timeout=30)
        return answer.status, json.loads(answer.data)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):  # then killed with its stubs below
                self.process.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the stubs, if the server left them
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self._log.close()
        for leftover in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            leftover.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Served]]:
    """The same model, its stub and packages from .venv ("numpy 1") and from here ("numpy 2"): both start at once."""
    _, _, wheel_root = models_environment(DEV_PYTHON)
    started: dict[str, Served] = {}
    try:
        for name, python in [("numpy 1", DEV_PYTHON), ("numpy 2", Path(sys.executable))]:
            started[name] = Served(python, wheel_root, tmp_path_factory.mktemp(name.replace(" ", "")))
        for served in started.values():
            served.wait_ready()
        yield started
    finally:
        for served in started.values():
            served.stop()


def test_numpy_1_in_the_python_backend_answers_right(servers: dict[str, Served]) -> None:
    served = servers["numpy 1"]
    assert str(served.seen()["numpy"]).startswith("1."), served.seen()
    status, body = served.infer()
    assert status == 200, f"{body}\n{served.log()}"
    (y,) = body["outputs"]
    assert y["shape"] == [2, 3] and y["data"] == (X * 2).ravel().tolist(), body


def test_numpy_2_in_the_python_backend_fails_every_request(servers: dict[str, Served]) -> None:
    """If this answers right, the wheel's Triton has learnt numpy 2: requirements/triton-image.txt's numpy<2 and
    tests/unit/test_triton_image.py's FIRST_NUMPY2_RELEASE may move with a base of that version."""
    served = servers["numpy 2"]
    seen = served.seen()
    assert str(seen["numpy"]).startswith("2.") and seen["python"] == list(sys.version_info[:2]), seen
    assert Path(str(seen["prefix"])) == Path(sys.prefix), seen  # the stub ran this environment's packages
    for _ in range(3):
        status, body = served.infer()
        assert status != 200, (f"Triton's python backend answered {body} with numpy {seen['numpy']}: it handles "
                               "numpy 2 now; revisit the numpy<2 pin of requirements/triton-image.txt")
        assert NUMPY2_FAILURE in str(body.get("error")), body
