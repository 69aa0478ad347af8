"""A real Triton Inference Server from the nvidia-pytriton wheel, for machines with no GPU and no docker.

    python -m devstack --model-repository triton_repo

serves a CPU copy of the repository (see cpu_repo.py) on loopback until Ctrl-C.
"""

from devstack.errors import EmbeddedTritonError
from devstack.server import EmbeddedTriton, EmbeddedTritonConfig

__all__ = ["EmbeddedTriton", "EmbeddedTritonConfig", "EmbeddedTritonError"]
