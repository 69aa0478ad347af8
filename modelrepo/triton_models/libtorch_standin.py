"""Python-backend stand-in for a `pytorch_libtorch` model, for Tritons built without libtorch.

devstack/cpu_repo.py copies it as each version's model.py, beside a link to the TorchScript file. It keeps the
libtorch backend's contract: `input__<i>` / `output__<i>` order, the thread count from INTRA_OP_THREAD_COUNT; a
KIND_GPU instance runs the model on its GPU, one forward() per merged batch as libtorch does.

On a CPU it answers the requests of a merged batch in their order, in forwards of at least MIN_FORWARD_IMAGES
images, each request as soon as its forward ends. A CPU forward costs the same per image from a few images up
(devstack/cpu_layout.py), so one forward of everything merged gains nothing and makes the first requests wait
for the last: two shim workers' batches of 7 and 5 merged into one of 12 answered the 7 after 360 ms instead of
210, and those merges were the shim's p99 (bench/RESULTS.md "The CPU copy answers a merged batch in order").
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

MIN_FORWARD_IMAGES = 4  # on a CPU: fewer images per forward cost more per image; more only delay the first


def _by_libtorch_index(tensors: list[dict]) -> list[dict]:
    """libtorch binds `name__<i>` tensors by <i>; others keep their config order."""

    def index(item: tuple[int, dict]) -> int:
        match = re.search(r"__(\d+)$", item[1]["name"])
        return int(match.group(1)) if match else item[0]

    return [t for _, t in sorted(enumerate(tensors), key=index)]


def in_order_chunks(sizes: list[int], at_least: int) -> list[range]:
    """Consecutive requests (by index) in groups of at least `at_least` images, the last group taking the rest."""
    chunks, start, images = [], 0, 0
    for i, size in enumerate(sizes):
        images += size
        if images >= at_least:
            chunks.append(range(start, i + 1))
            start, images = i + 1, 0
    if start < len(sizes):  # a short tail joins the group before it (or is the only one)
        chunks.append(range(chunks.pop().start if chunks else start, len(sizes)))
    return chunks


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
        self.in_order = not gpu  # a merged batch answered in order, in forwards of a few images (the docstring)

    def execute(self, requests: list) -> list | None:
        arrays = [[pb_utils.get_input_tensor_by_name(r, name).as_numpy() for name in self.inputs]
                  for r in requests]
        if not self.batched:
            return [self._respond(lambda a=a: [self._forward(a)])[0] for a in arrays]
        sizes = [a[0].shape[0] for a in arrays]
        chunks = in_order_chunks(sizes, MIN_FORWARD_IMAGES) if self.in_order else [range(len(requests))]
        if len(chunks) == 1:  # one forward: the responses go back together, as libtorch's do
            return self._respond(lambda: self._merged(arrays), len(requests))
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for chunk in chunks:  # each answered as soon as its forward ends
            responses = self._respond(lambda c=chunk: self._merged([arrays[i] for i in c]), len(chunk))
            for i, response in zip(chunk, responses, strict=True):
                try:
                    requests[i].get_response_sender().send(response, flags=final)
                except Exception as e:  # this request's sender only (its client gone): the others are answered
                    pb_utils.Logger.log_warn(f"libtorch stand-in: a response was not sent: {type(e).__name__}: {e}")
        return None

    def _respond(self, run, count: int = 1) -> list:
        """The responses of `count` requests whose outputs `run` computes; the model failing, each gets the error."""
        try:
            per_request = run()
        except Exception as e:
            error = pb_utils.TritonError(f"{type(e).__name__}: {e}")
            return [pb_utils.InferenceResponse(error=error) for _ in range(count)]
        return [pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor(name, out.astype(dtype, copy=False))
            for (name, dtype), out in zip(self.outputs, outs, strict=True)]) for outs in per_request]

    def _merged(self, arrays: list[list[np.ndarray]]) -> list[list[np.ndarray]]:
        """One forward() of the requests' inputs concatenated, its outputs cut back per request."""
        sizes = [a[0].shape[0] for a in arrays]
        results = self._forward([np.concatenate(column) for column in zip(*arrays, strict=True)])
        offsets = np.cumsum([0, *sizes])
        return [[r[offsets[i]:offsets[i + 1]] for r in results] for i in range(len(arrays))]

    def _forward(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        with torch.inference_mode():
            result = self.model(*[torch.from_numpy(np.ascontiguousarray(a)).to(self.device) for a in inputs])
        results = result if isinstance(result, (tuple, list)) else (result,)
        if len(results) < len(self.outputs):
            raise RuntimeError(f"model returned {len(results)} outputs, config names {len(self.outputs)}")
        return [r.cpu().numpy() for r in results[:len(self.outputs)]]
