"""Python-backend stand-in for a `pytorch_libtorch` model, for Tritons built without libtorch.

devstack/cpu_repo.py copies it as each version's model.py, beside a link to the TorchScript file. It keeps the
libtorch backend's contract: `input__<i>` / `output__<i>` order, one forward() per merged batch, the thread count
from INTRA_OP_THREAD_COUNT; a KIND_GPU instance runs the model on its GPU.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import torch
import triton_python_backend_utils as pb_utils


def _by_libtorch_index(tensors: list[dict]) -> list[dict]:
    """libtorch binds `name__<i>` tensors by <i>; others keep their config order."""

    def index(item: tuple[int, dict]) -> int:
        match = re.search(r"__(\d+)$", item[1]["name"])
        return int(match.group(1)) if match else item[0]

    return [t for _, t in sorted(enumerate(tensors), key=index)]


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        threads = int(params.get("INTRA_OP_THREAD_COUNT", "0"))
        if threads > 0:
            torch.set_num_threads(threads)
        torch.set_num_interop_threads(int(params.get("INTER_OP_THREAD_COUNT", "1")))

        filename = params.get("SOURCE_MODEL_FILENAME", "model.pt")
        path = os.path.join(args["model_repository"], args["model_version"], filename)
        gpu = args.get("model_instance_kind") == "GPU" and torch.cuda.is_available()
        device_id = int(args.get("model_instance_device_id", "0"))
        self.device = torch.device("cuda", device_id) if gpu else torch.device("cpu")
        self.model = torch.jit.load(path, map_location=self.device).eval()
        self.inputs = [t["name"] for t in _by_libtorch_index(config["input"])]
        self.outputs = [(t["name"], pb_utils.triton_string_to_numpy(t["data_type"]))
                        for t in _by_libtorch_index(config["output"])]
        self.batched = int(config.get("max_batch_size", 0)) > 0

    def execute(self, requests: list) -> list:
        arrays = [[pb_utils.get_input_tensor_by_name(r, name).as_numpy() for name in self.inputs]
                  for r in requests]
        sizes = [a[0].shape[0] for a in arrays] if self.batched else [0] * len(arrays)
        try:
            if self.batched:  # one forward() for everything the dynamic batcher merged
                merged = [np.concatenate(column) for column in zip(*arrays, strict=True)]
                results = self._forward(merged)
                offsets = np.cumsum([0, *sizes])
                per_request = [[r[offsets[i]:offsets[i + 1]] for r in results] for i in range(len(requests))]
            else:
                per_request = [self._forward(a) for a in arrays]
        except Exception as e:  # the model failed: every request in this batch gets its own error
            error = pb_utils.TritonError(f"{type(e).__name__}: {e}")
            return [pb_utils.InferenceResponse(error=error) for _ in requests]

        responses = []
        for outs in per_request:
            tensors = [pb_utils.Tensor(name, out.astype(dtype, copy=False))
                       for (name, dtype), out in zip(self.outputs, outs, strict=True)]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses

    def _forward(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        with torch.inference_mode():
            result = self.model(*[torch.from_numpy(np.ascontiguousarray(a)).to(self.device) for a in inputs])
        results = result if isinstance(result, (tuple, list)) else (result,)
        if len(results) < len(self.outputs):
            raise RuntimeError(f"model returned {len(results)} outputs, config names {len(self.outputs)}")
        return [r.cpu().numpy() for r in results[:len(self.outputs)]]
