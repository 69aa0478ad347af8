# CI only (`make compose-test`, tests/compose/ci.yml): stands in for docker/triton.Dockerfile where NGC's
# image cannot be pulled. The same Triton release (2.51.0, the nvidia-pytriton 0.7.0 wheel) run by
# `python -m devstack`, which lays out the wheel's python backend and serves a CPU copy of the
# mounted repository; tests/compose/ci.yml mounts modelrepo/standin.py's numpy copy of triton_repo there
# (no torch in this image). Never a product image: users run docker/triton.Dockerfile.
#
# Built only from the local base image and a wheelhouse in the build context (no network, no registry):
#   docker build -f docker/ci-triton.Dockerfile --build-arg WHEELHOUSE=wheelhouse/ci-triton .
ARG PYTHON_IMAGE=flask-triton-shim-ci/python:3.11-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG WHEELHOUSE=wheelhouse/ci-triton
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY ${WHEELHOUSE} /wheelhouse/
# The server (its binary, backends and libraries ship in the wheel), what devstack imports
# and what the python-backend models import: pyproject.toml's `ci-triton` group, locked in
# requirements/ci-triton.txt at the versions `make test` ran (each file checked against its hash).
COPY requirements/ci-triton.txt /tmp/
RUN python -m venv /opt/triton \
 && /opt/triton/bin/pip install --no-index --find-links /wheelhouse --require-hashes -r /tmp/ci-triton.txt

FROM ${PYTHON_IMAGE}
# The venv's python3 first on PATH: the python-backend stub finds its packages through it (and the compose
# healthcheck's `python3` is this one).
ENV PATH=/opt/triton/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# uid/gid 1000 as NGC's `triton-server`; the CPU copy of the repository is written to its cache folder.
RUN groupadd --gid 1000 triton-server \
 && useradd --no-log-init --uid 1000 --gid triton-server --no-create-home --shell /usr/sbin/nologin triton-server \
 && mkdir -p /var/cache/embedded-triton \
 && chown triton-server:triton-server /var/cache/embedded-triton
COPY --from=build /opt/triton /opt/triton
WORKDIR /srv/triton
# devstack runs the server; it reads model descriptions with app.description and modelrepo's generator.
COPY app ./app
COPY devstack ./devstack
COPY modelrepo ./modelrepo
USER 1000:1000
EXPOSE 8000 8001 8002
CMD ["python", "-m", "devstack", "--host", "0.0.0.0", "--model-repository", "/models", \
     "--cache-dir", "/var/cache/embedded-triton"]
