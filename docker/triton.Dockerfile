# Triton for docker-compose.yml and deploy/k8s: NVIDIA's image plus what `resnet50_decode` (the encoded transport:
# its 1/model.py is the export's copy of modelrepo/triton_models/decode.py) runs with: nvImageCodec with nvJPEG,
# torch and torchvision. requirements/triton-image.txt pins the versions the decode step is tested with in
# `make test` (requirements/dev.txt: numpy 1.26.4, torch 2.14.1, torchvision 0.29.1, nvImageCodec cu13
# 0.9.0.20; tests/unit/test_triton_image.py holds the two equal), inside the same server, the wheel's 2.51.0.
# numpy stays below 2: 24.10's python backend stub is built with pybind11 2.10, which cannot read numpy 2 arrays
# (python_backend #384, pybind11 2.12, is in 24.11 and later); with numpy 2 the decode step would fail and the
# shim would decode every upload on its own CPU. A base of 24.11 or later may take numpy 2 (the test lets it).
# torch 2.14's PyPI wheels and nvImageCodec cu13 bring their own CUDA 13 runtime, beside the image's CUDA 12.6:
# the host's driver must be 580 or newer (`nvidia-smi`). torch adds about 2.5 GB; an image that never serves
# the encoded transport can drop requirements/triton-image.txt and resnet50_decode / resnet50_encoded.
#
# 24.10 is the NGC release of Triton 2.51.0, the server that nvidia-pytriton 0.7.0 ships and that
# `make test` runs against (tests/integration/test_deploy_live.py checks that the two stay in step). Its libtorch
# backend reads TorchScript file format versions up to 10, like every PyTorch since 2022; modelrepo/export.py
# writes version 3 for ResNets (tests/unit/test_deploy.py checks that too).
#
#   docker build -f docker/triton.Dockerfile -t flask-triton-shim/triton:24.10 .
#
# No `# syntax=` line: it makes BuildKit pull a frontend image from Docker Hub before building, which fails
# behind a firewall or a registry mirror that lacks it; the frontend built into the engine reads this file.
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:24.10-py3
FROM ${TRITON_IMAGE}
# The python backend runs models with the image's system python3; newer bases mark it externally managed.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1
# Empty (the default): the wheels come from PyPI. A folder of the build context (wheelhouse/triton): from that
# folder alone, no network (wheelhouse/README.md). COPY needs a source that exists: without a wheelhouse
# it copies the README. The copied wheels stay in that layer.
# requirements/triton-image.txt (`make lock`): the versions, each file checked against its hash.
ARG WHEELHOUSE=
COPY ${WHEELHOUSE:-wheelhouse/README.md} /tmp/wheelhouse/
COPY requirements/triton-image.txt /tmp/
RUN python3 -m pip install --no-cache-dir ${WHEELHOUSE:+--no-index --find-links /tmp/wheelhouse} \
      --require-hashes -r /tmp/triton-image.txt \
 && rm -rf /tmp/wheelhouse /tmp/triton-image.txt
# The image's own non-root user: Triton's build creates `triton-server` with uid and gid 1000 for this.
USER 1000:1000
CMD ["tritonserver", "--model-repository=/models", "--model-control-mode=explicit", "--load-model=*"]
