"""Hot reload on a running server: a new version folder, one load call, no failed request, warm before ready."""

from __future__ import annotations

import secrets
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from devstack.cpu_repo import read_config
from tests.conftest import make_test_repo, start_triton
from tests.support import wait_until

pytestmark = pytest.mark.triton


def test_new_version_serves_after_load_and_no_request_fails(tmp_path: Path, test_model_pt: Path,
                                                             seed1_model_pt: Path) -> None:
    import torch

    repo = make_test_repo(tmp_path / "triton_repo", test_model_pt, only_resnet50=True)
    v2_model = torch.jit.load(str(seed1_model_pt), map_location="cpu").eval()  # other weights than version 1
    server = start_triton(repo, tmp_path / "cache", admin_key=secrets.token_hex(16))  # as `make run` does
    stop, failures, answered = threading.Event(), [], [0]
    image = np.random.default_rng(3).standard_normal((1, 3, 224, 224), dtype=np.float32)

    def keep_sending() -> None:
        client = httpclient.InferenceServerClient(server.http_url, network_timeout=60)
        tensor = _input(image)
        while not stop.is_set():
            try:
                client.infer("resnet50", [tensor])
                answered[0] += 1
            except Exception as e:
                failures.append(repr(e))
        client.close()

    sender = threading.Thread(target=keep_sending)
    sender.start()
    try:
        wait_until(lambda: answered[0] >= 3, 60, "requests to flow before the reload")
        staging = tmp_path / "staging"
        staging.mkdir()
        shutil.copy(seed1_model_pt, staging / "model.pt")  # a real file, as a deployment would copy it
        staging.rename(repo / "resnet50" / "2")  # the whole folder appears at once, as `cp -r` + `mv` would

        wait_until(lambda: (server.cpu_repo / "resnet50" / "2" / "model.py").is_file(), 10,
                   "the CPU copy to pick up version 2")
        admin = httpclient.InferenceServerClient(server.http_url, network_timeout=120)
        admin.load_model("resnet50", headers=server.config.admin_headers)  # POST .../models/resnet50/load
        # Warm before ready: version 2 ran its model_warmup (2 runs of a batch of 8 on each instance: 16 per
        # instance) before the load call returned. The sender, one request at a time, cannot have sent it 16
        # requests in the moment since. (The CPU copy runs 2 instances, or 1 where that is faster here.)
        instances = read_config(server.cpu_repo / "resnet50" / "config.pbtxt").instance_group[0].count
        (stats,) = admin.get_inference_statistics("resnet50", "2")["model_stats"]
        assert int(stats["inference_count"]) >= 16 * instances, stats
        assert int(stats["execution_count"]) >= 2 * instances, stats
        assert admin.is_model_ready("resnet50", "2")
        served_before = answered[0]
        wait_until(lambda: answered[0] >= served_before + 3, 60, "requests after the reload")

        result = admin.infer("resnet50", [_input(image)])
        with torch.inference_mode():
            expected = v2_model(torch.from_numpy(image)).numpy()
        np.testing.assert_allclose(result.as_numpy("output__0"), expected, rtol=0, atol=1e-4)
        assert admin.get_model_metadata("resnet50")["versions"] == ["2"]
        admin.close()
    finally:
        stop.set()
        sender.join(timeout=60)
        server.stop(graceful=False)
    assert failures == [], f"{len(failures)} of {answered[0] + len(failures)} requests failed: {failures[:3]}"


def _input(image: np.ndarray) -> httpclient.InferInput:
    tensor = httpclient.InferInput("input__0", list(image.shape), "FP32")
    tensor.set_data_from_numpy(image, binary_data=True)
    return tensor
