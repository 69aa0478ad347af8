"""A real Triton Inference Server from the nvidia-pytriton wheel, for machines with no GPU and no docker.

    python -m app.embedded_triton --model-repository triton_repo

serves a CPU copy of the repository (see cpu_repo.py) on loopback until Ctrl-C.
"""

from app.embedded_triton.errors import EmbeddedTritonError
from app.embedded_triton.server import EmbeddedTriton, EmbeddedTritonConfig

__all__ = ["EmbeddedTriton", "EmbeddedTritonConfig", "EmbeddedTritonError"]
