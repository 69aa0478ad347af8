# The shim's image: Flask + gunicorn + tritonclient, forwarding /predict to Triton. Non-root, no compilers.
#
#   docker build -t flask-triton-shim .                                        # WITH_LEGACY=0, the default
#   docker build --build-arg WITH_LEGACY=1 -t flask-triton-shim:legacy .
#   docker build --build-arg WHEELHOUSE=wheelhouse/shim -t flask-triton-shim .   # offline: wheelhouse/README.md
#
# No `# syntax=` line: it makes BuildKit pull a frontend image from Docker Hub before building, which fails
# behind a firewall or a registry mirror that lacks it; the frontend built into the engine reads this file.
#
# WITH_LEGACY=0 (default) installs what SHIM_MODE=triton needs and nothing else: once the migration is
# done the shim only forwards to Triton, and torch would be ~1 GB of dead weight, even as a CPU build.
# WITH_LEGACY=1 adds the `legacy` extra (torch + torchvision as pinned in pyproject.toml, CPU builds) for
# SHIM_MODE=legacy|shadow|canary, SHIM_FALLBACK and `shim-export`. docker-compose.yml builds
# that one by default, so that the traffic flag can be switched there without a rebuild.
#
# The image expects the Triton model repository (the model's description model.toml, labels.txt, and model.pt
# for the legacy modes) at /models, mounted read-only: see docker-compose.yml and deploy/k8s/.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG WITH_LEGACY=0
# Empty (the default): packages come from PyPI. A folder of the build context (wheelhouse/shim): they come
# from that folder alone, with no network at all (`pip download` fills it; see wheelhouse/README.md).
ARG WHEELHOUSE=
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
# The locks (`make lock`): every package at the version CI tested, each file checked against its hash.
COPY requirements/shim.txt requirements/shim-legacy.txt requirements/torch-cpu.txt ./requirements/
COPY app ./app
COPY modelrepo ./modelrepo
COPY report ./report
# COPY needs a source that exists: without a wheelhouse this copies its README, which pip ignores. Only
# this build stage sees the wheels; the runtime stage below takes the virtualenv alone.
COPY ${WHEELHOUSE:-wheelhouse/README.md} /wheelhouse/
# One virtualenv, copied whole into the runtime stage (no pip, cache or build files left behind there):
# requirements/shim.txt (WITH_LEGACY=0), or requirements/shim-legacy.txt and then torch and torchvision as
# PyTorch's CPU builds from its CPU index, ~200 MB instead of the several GB of CUDA libraries of PyPI's
# builds, which the shim never uses (requirements/torch-cpu.txt: pip checks their hashes where the file
# has them). The shim itself last, built by the locked setuptools, offline. With a wheelhouse, everything
# comes from it (--no-index): download the "+cpu" wheels into it (wheelhouse/README.md).
RUN python -m venv /opt/shim \
 && if [ "$WITH_LEGACY" = "1" ]; then \
      /opt/shim/bin/pip install ${WHEELHOUSE:+--no-index --find-links /wheelhouse} \
        --require-hashes -r requirements/shim-legacy.txt \
      && if [ -n "$WHEELHOUSE" ]; then \
           /opt/shim/bin/pip install --no-index --find-links /wheelhouse --no-deps -r requirements/torch-cpu.txt; \
         else \
           /opt/shim/bin/pip install --index-url https://download.pytorch.org/whl/cpu --no-deps \
             -r requirements/torch-cpu.txt; \
         fi; \
    else \
      /opt/shim/bin/pip install ${WHEELHOUSE:+--no-index --find-links /wheelhouse} \
        --require-hashes -r requirements/shim.txt; \
    fi \
 && /opt/shim/bin/pip install --no-index --no-deps --no-build-isolation .

FROM ${PYTHON_IMAGE} AS runtime
ENV PATH=/opt/shim/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SHIM_PORT=5000 \
    SHIM_MODEL_REPOSITORY=/models
# /var/run/shim holds the traffic flag file (SHIM_FLAG_FILE); a volume mounted there inherits this owner.
RUN groupadd --system --gid 10001 shim \
 && useradd --system --no-log-init --uid 10001 --gid shim --no-create-home --shell /usr/sbin/nologin shim \
 && mkdir -p /var/run/shim \
 && chown shim:shim /var/run/shim
COPY --from=build /opt/shim /opt/shim
WORKDIR /srv/shim
USER 10001:10001
EXPOSE 5000
# No curl in the slim image: the standard library does the check (any error or non-2xx status exits 1).
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('SHIM_PORT', '5000'), timeout=3)"]
ENTRYPOINT ["shim-serve"]
