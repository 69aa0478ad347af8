"""Triton python-backend stand-in for a decode step: its exact interface (BYTES [N, 1] -> FP32 CHW, READABLE),
almost no compute, so that a benchmark of the `encoded` route measures the shim, as on a GPU host.

Written by modelrepo/standin.py (near_free_decode), never part of triton_repo/. Every row starting as a JPEG does
(FF D8) is readable and answers zeros; any other row is refused, as the real decoder refuses what it cannot read.
"""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

READABLE = "readable"


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        (inp,) = config["input"]
        decoded = next(o for o in config["output"] if o["name"] != READABLE)
        self.input_name, self.output_name = inp["name"], decoded["name"]
        shape = [max(1, int(config.get("max_batch_size", 1)))] + [int(d) for d in decoded["dims"]]
        self.zeros = np.zeros(shape, dtype=np.float32)  # made once: a batch's answer is a view of it

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            rows = pb_utils.get_input_tensor_by_name(request, self.input_name).as_numpy().reshape(-1)
            readable = np.array([[bytes(row[:2]) == b"\xff\xd8"] for row in rows], dtype=bool)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor(self.output_name, self.zeros[:len(rows)]), pb_utils.Tensor(READABLE, readable)]))
        return responses
