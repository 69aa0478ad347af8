"""SHIM_TRANSPORT=uint8: the cropped pixels [N, crop, crop, 3] UINT8 to `<name>_uint8`, which normalises them."""

from __future__ import annotations

from typing import Any

import numpy.typing as npt

from app.backends.triton.checks import check_pin
from app.backends.triton.fp32 import Fp32Transport
from app.images import Upload


class Uint8Transport(Fp32Transport):
    name = "uint8"
    datatype = "UINT8"

    @property
    def model(self) -> str:
        return self.target.uint8_model

    @property
    def version(self) -> str:
        return ""  # the ensemble's own; SHIM_MODEL_VERSION is the classifier's, held by the ensemble's step

    def image_shape(self) -> tuple[int, int, int]:
        return (*self.target.crop, 3)

    def describe(self) -> str:
        return f"UINT8 pixels {list(self.image_shape())} per image to {self.model}, which normalises them"

    def prepare(self, upload: Upload) -> npt.NDArray[Any]:
        return upload.pixels()

    def check_config(self, config: dict[str, Any]) -> None:
        check_pin(config, ensemble=self.model, classifier=self.target.model, pin=self.target.version,
                  where=self.where())
