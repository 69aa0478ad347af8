"""A real Triton Inference Server from the nvidia-pytriton wheel, for machines with no GPU and no docker:
`python -m devstack --model-repository triton_repo` serves a CPU copy of it (cpu_repo.py) until Ctrl-C."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from devstack.errors import EmbeddedTritonError

if TYPE_CHECKING:
    from devstack.server import EmbeddedTriton, EmbeddedTritonConfig

__all__ = ["EmbeddedTriton", "EmbeddedTritonConfig", "EmbeddedTritonError"]


def __getattr__(name: str) -> Any:
    # The server needs protobuf and tritonclient[grpc]; `make test-prod` imports devstack.launch without them.
    if name in ("EmbeddedTriton", "EmbeddedTritonConfig"):
        return getattr(importlib.import_module("devstack.server"), name)
    raise AttributeError(f"module 'devstack' has no attribute {name!r}")
