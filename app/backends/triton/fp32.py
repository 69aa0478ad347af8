"""SHIM_TRANSPORT=fp32 (the default): the shim's normalised FP32 tensors [N, 3, crop, crop] to the model itself."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import tritonclient.http as httpclient

from app.backends.triton.checks import ModelSpec, check_model
from app.backends.triton.client import Clients
from app.backends.triton.transport import Row, Transport, log_answer
from app.errors import ShimError
from app.images import Upload


class Fp32Transport(Transport):
    name = "fp32"
    datatype = "FP32"

    @property
    def model(self) -> str:
        return self.target.model

    @property
    def version(self) -> str:
        return self.target.version

    def image_shape(self) -> tuple[int, int, int]:
        return (3, *self.target.crop)

    def describe(self) -> str:
        return f"FP32 tensors {list(self.image_shape())} per image to {self.model}"

    def prepare(self, upload: Upload) -> npt.NDArray[Any]:
        return upload.tensor()

    def infer(self, clients: Clients, items: Sequence[npt.NDArray[Any]], request_id: str) -> list[Row | ShimError]:
        return list(self.send(clients, np.stack(items), request_id))

    def send(self, clients: Clients, batch: npt.NDArray[Any], request_id: str) -> npt.NDArray[np.float32]:
        spec = self.spec or self.check(clients)
        tensor = httpclient.InferInput(spec.input_name, list(batch.shape), self.datatype)
        tensor.set_data_from_numpy(batch, binary_data=True)
        wanted = httpclient.InferRequestedOutput(spec.output_name, binary_data=True)
        where = self.where()
        result = clients.infer(self.model, [tensor], version=self.version, outputs=[wanted], request_id=request_id,
                               where=where)
        log_answer(result, len(batch))
        return self.checked(result.as_numpy(spec.output_name), len(batch), where)

    def check(self, clients: Clients) -> ModelSpec:
        meta = clients.call(lambda c: c.get_model_metadata(self.model, self.version), where=self.where())
        config = clients.call(lambda c: c.get_model_config(self.model, self.version), where=self.where())
        self.check_config(config)
        self.spec = check_model(meta, config, image_shape=self.image_shape(), classes=self.target.classes,
                                where=self.where(), datatype=self.datatype, parameters=self.target.parameters)
        return self.spec

    def check_config(self, config: dict[str, Any]) -> None:
        """What else the model's config must say (an ensemble: the classifier version it runs)."""
