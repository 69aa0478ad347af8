# flask-triton-shim: `make run` serves /predict through a real local Triton; `make test` runs the tests.
# Both set everything up on a fresh machine (virtualenv, packages, model export) first.

# The dev environment's Python (make run, make test): python3 when it is 3.11 or 3.12, else the first of those
# found (PATH, then pyenv). make test-prod's: the newest the shim supports (3.13, 3.12, 3.11), to prove it on
# another Python than the dev one. Set either to choose: `make test PYTHON=python3.12`.
ifeq ($(origin PYTHON), undefined)
PYTHON := $(shell python3 requirements/lock.py --find-python dev 2>/dev/null || echo python3)
endif
ifeq ($(origin PROD_PYTHON), undefined)
PROD_PYTHON := $(shell python3 requirements/lock.py --find-python prod 2>/dev/null || echo python3)
endif
VENV   := .venv
PY     := $(VENV)/bin/python
PROD_VENV := .venv-prod
PROD_PY   := $(PROD_VENV)/bin/python
UV     := .cache/tools/uv/bin/uv
ARCH   ?= resnet50
MODEL  := triton_repo/resnet50/1/model.pt
PYTEST_ARGS ?=
PROMTOOL := .cache/tools/promtool
NGINX    := .cache/tools/nginx/usr/sbin/nginx

.PHONY: help install export triton run test test-prod lint lock clean promtool nginx

help:
	@echo "make run     - export the model, start a local Triton (wheel, CPU) and the shim on :5000"
	@echo "make test    - lint and run every test against a real local Triton"
	@echo "make compose-test - build the images and run docker-compose.yml for real (docker engine, root; no GPU)"
	@echo "make k8s-test - render deploy/k8s with kustomize and run its Deployments as pods (podman kube play, root; no GPU)"
	@echo "make hostile-test - slow clients, floods, oversize and broken bodies, a hung Triton, through nginx (about 5 min)"
	@echo "make triton  - only the local Triton on :8000/:8001/:8002"
	@echo "make export  - write $(MODEL) (ARCH=resnet50|resnet18, SHIM_MODEL_WEIGHTS=file.pth) from triton_repo/resnet50/model.toml"
	@echo "               your own model: shim-export --model NAME (README: Your own model)"
	@echo "               and shim-check your_app:transform IMAGES --model NAME"
	@echo "make lint    - ruff and mypy"
	@echo "make test-prod - the production packages alone (requirements/shim.txt: numpy 2, no torch) on $(PROD_PYTHON): the unit tests that need nothing else, and /predict through the dev Triton"
	@echo "make lock    - rewrite requirements/*.txt (every install, with hashes) from pyproject.toml; commit them (UPGRADE=1: newest releases)"
	@echo "make promtool - unpack promtool (Prometheus' checker) into .cache/tools for the deploy tests"
	@echo "make nginx   - unpack nginx (Debian's package, no install, no root) into .cache/tools for the proxy tests"
	@echo "make bench   - the Flask-vs-Triton benchmark, about 10 min (bench/RESULTS.md; BENCH_ARGS=--help)"
	@echo "make bench-quick - the same in under 2 minutes (resnet18, fewer and shorter runs)"
	@echo "make bench-frontend - the shim's CPU per image with a near-free model: floor, legacy front, each transport, direct (about 5 min; BENCH_ARGS=--profile)"
	@echo "make bench-memory - a shim worker's peak memory under the worst input its limits accept (about 3 min)"
	@echo "make clean   - remove what make, the tests and the benchmarks wrote (.cache, exported models, bench/out: 20-30 MB a run)"

# Installs only what a lock file names, every file hash-checked, with uv: 30 s here where pip took 3 minutes
# (docs/testing.md). The locks are made from PyPI, uv's default index; where uv cannot reach it (a mirror only
# pip's configuration knows), pip installs the same lock with its own configuration. $(1): the virtualenv's
# python, $(2): the lock.
define install_lock
	$(UV) pip install --quiet --python $(1) --require-hashes -r $(2) \
	  || { echo "make: uv could not install $(2) (above); pip installs it, with pip's configuration" >&2; \
	       $(1) -m pip install --quiet --require-hashes -r $(2); }
	$(UV) pip install --quiet --python $(1) --no-deps --no-build-isolation -e .
endef

# requirements/lock.py --check stops first, saying what to do, when this Python cannot run the environment or
# pyproject.toml changed since `make lock`.
$(VENV)/.installed: pyproject.toml requirements/dev.txt requirements/inputs.json | $(UV)
	@$(PYTHON) requirements/lock.py --check dev
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(call install_lock,$(PY),requirements/dev.txt)
	touch $@

install: $(VENV)/.installed

# Re-run when the arch changes: the tool keeps a model.pt that already holds what was asked for.
export: install
	$(PY) -m modelrepo.export --arch $(ARCH)

triton: export
	$(PY) -m devstack --model-repository triton_repo

run: export
	$(PY) -m devstack.run

# Bytecode caching on even where the environment turns it off (PYTHONDONTWRITEBYTECODE): the suite starts
# dozens of Python processes, and pytest would otherwise rewrite the asserts of ~400 plugin modules at every
# start (about 5 s of each run here). __pycache__ is gitignored.
test: export lint promtool nginx
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest $(PYTEST_ARGS)

# `docker compose up` for real: installs a docker engine, Compose v2 and debootstrap when missing, starts
# dockerd when none runs (and stops it after), builds the images from local bases and a wheelhouse, runs
# docker-compose.yml with tests/compose/ci.yml and checks it from the host (tests/compose/driver.py).
.PHONY: compose-test
compose-test: install
	$(PY) -m tests.compose.driver

# deploy/k8s for real, as far as one host can: renders it with kustomize (kubectl's), builds the compose test's
# images, plays the Deployments as pods with podman 4.3 (installed when missing) and checks them as a kubelet
# would (tests/k8s/driver.py, tests/k8s/). K8S_ARGS=--mutate=probe-path|command|env-name plays a broken manifest.
.PHONY: k8s-test
K8S_ARGS ?=
k8s-test: install
	$(PY) -m tests.k8s.driver $(K8S_ARGS)

# promtool (Prometheus' checker for deploy/prometheus/) is not on PyPI: it is taken out of Debian's
# `prometheus` package, unpacked here without installing the server. Where apt is missing, the tests
# that need it skip (and fail under CI=true).
promtool: $(PROMTOOL)
$(PROMTOOL):
	@mkdir -p $(@D)
	@cd $(@D) && if command -v apt-get >/dev/null; then \
	  { apt-get download prometheus >/dev/null 2>&1 || { apt-get update -qq && apt-get download prometheus; }; } \
	  && dpkg-deb --fsys-tarfile prometheus_*.deb | tar -xO ./usr/bin/promtool > promtool.tmp \
	  && chmod +x promtool.tmp && mv promtool.tmp promtool; rm -f prometheus_*.deb promtool.tmp; \
	else echo "no apt-get here: the promtool checks will be skipped"; fi

# nginx, the proxy in front of gunicorn (deploy/nginx/), for `nginx -t` in make test and for make hostile-test:
# the binary of Debian's `nginx` package (it needs only libc, libssl, libpcre2, zlib, libcrypt), unpacked here
# without installing the package or touching the system's nginx service. Without apt-get, an nginx on PATH
# is used; without either, the checks that need it skip (and fail under CI=true).
nginx: $(NGINX)
$(NGINX):
	@mkdir -p .cache/tools/nginx
	@cd .cache/tools/nginx && if command -v apt-get >/dev/null; then \
	  { apt-get download nginx >/dev/null 2>&1 || { apt-get update -qq && apt-get download nginx; }; } \
	  && dpkg-deb -x nginx_*.deb . && ./usr/sbin/nginx -v; rm -f nginx_*.deb; \
	else echo "no apt-get here: install nginx (brew install nginx, ...) or the proxy checks will be skipped"; fi

# The hostile-clients suite (tests/hostile/): the wheel's Triton, the shim as `make run` starts it and nginx
# with deploy/nginx's configuration in front, attacked and measured; prints the figures. Not part of make test.
.PHONY: hostile-test
hostile-test: install nginx
	HOSTILE_STACK=1 $(PY) -m pytest tests/hostile -v -p no:cacheprovider --tb=short $(PYTEST_ARGS)

.PHONY: bench bench-quick bench-frontend bench-memory
BENCH_ARGS ?=
bench: install
	$(PY) -m bench $(BENCH_ARGS)

bench-quick: install
	$(PY) -m bench --quick $(BENCH_ARGS)

bench-frontend: install nginx  # nginx: the row behind deploy/nginx (the estimate as deployed)
	$(PY) -m bench --frontend $(BENCH_ARGS)

# The production shim's packages (requirements/shim.txt: numpy 2, no torch, no Triton) and pytest, on another
# Python: the tests marked `prod` (pyproject.toml), among them /predict through the dev environment's Triton.
$(PROD_VENV)/.installed: pyproject.toml requirements/prod-test.txt requirements/inputs.json | $(UV)
	@$(PROD_PYTHON) requirements/lock.py --check prod
	test -x $(PROD_PY) || $(PROD_PYTHON) -m venv $(PROD_VENV)
	$(call install_lock,$(PROD_PY),requirements/prod-test.txt)
	touch $@

test-prod: $(PROD_VENV)/.installed install
	env -u PYTHONDONTWRITEBYTECODE TESTS_ENV=production $(PROD_PY) -m pytest -m prod $(PYTEST_ARGS)

# Every lock file of requirements/ from pyproject.toml (requirements/lock.py says how they chain), with uv from
# its own locked virtualenv (the installs above use it too). Needs PyPI; it never reads pip's configuration or a
# local index. It keeps the pins that still fit; `make lock UPGRADE=1` takes the newest releases the bounds allow.
lock: $(UV)
	$(PYTHON) requirements/lock.py --uv $(UV) $(if $(UPGRADE),--upgrade)

$(UV): requirements/uv.txt
	rm -rf .cache/tools/uv
	$(PYTHON) -m venv .cache/tools/uv
	.cache/tools/uv/bin/python -m pip install --quiet --require-hashes --no-deps -r requirements/uv.txt

bench-memory: export
	$(PY) -m bench --memory $(BENCH_ARGS)

lint: install
	$(PY) -m ruff check app modelrepo report devstack tests bench requirements/lock.py
	$(PY) -m mypy

clean:
	rm -rf .cache .pytest_cache .mypy_cache .ruff_cache bench/out
	find triton_repo -name model.pt -delete -o -name labels.txt -delete -o -name __pycache__ -prune -exec rm -rf {} +
