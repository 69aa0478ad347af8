# Triton for docker-compose.yml and deploy/k8s: NVIDIA's image plus Pillow for the `preprocess` model
# (triton_repo/preprocess/1/model.py; numpy is already in the image), and for `resnet50_decode` (the encoded
# transport: its 1/model.py is the export's copy of modelrepo/triton_models/decode.py) nvImageCodec with nvJPEG and
# torch + torchvision, all built for CUDA 12 as the image is (24.10: CUDA 12.6; torch 2.5.1's PyPI wheels are
# CUDA 12.4 builds, which run on its driver). torch adds about 2.5 GB; an image that never serves the encoded transport can drop
# those three lines and resnet50_decode / resnet50_encoded from its repository.
#
# 24.10 is the NGC release of Triton 2.51.0, the server that nvidia-pytriton 0.7.0 ships and that
# `make test` runs against (tests/test_deploy.py checks that the two stay in step). Its libtorch backend
# reads TorchScript file format versions up to 10, like every PyTorch since 2022; modelrepo/export.py
# writes version 3 for ResNets (tests/test_deploy.py checks that too).
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
# Empty (the default): Pillow comes from PyPI. A folder of the build context (wheelhouse/triton): from that
# folder alone, no network (wheelhouse/README.md). COPY needs a source that exists: without a wheelhouse
# it copies the README. The copied wheels stay in that layer (Pillow's is about 4 MB).
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
