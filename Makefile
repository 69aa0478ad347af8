# flask-triton-shim: `make run` serves /predict through a real local Triton; `make test` runs the tests.
# Both set everything up on a fresh machine (virtualenv, packages, model export) first.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
ARCH   ?= resnet50
MODEL  := triton_repo/resnet50/1/model.pt
PYTEST_ARGS ?=
PROMTOOL := .cache/tools/promtool
NGINX    := .cache/tools/nginx/usr/sbin/nginx

.PHONY: help install export triton run test lint clean promtool nginx

help:
	@echo "make run     - export the model, start a local Triton (wheel, CPU) and the shim on :5000"
	@echo "make test    - lint and run every test against a real local Triton"
	@echo "make compose-test - build the images and run docker-compose.yml for real (docker engine, root; no GPU)"
	@echo "make hostile-test - slow clients, floods, oversize and broken bodies, a hung Triton, through nginx (about 5 min)"
	@echo "make triton  - only the local Triton on :8000/:8001/:8002"
	@echo "make export  - write $(MODEL) (ARCH=resnet50|resnet18, SHIM_MODEL_WEIGHTS=file.pth)"
	@echo "make lint    - ruff and mypy"
	@echo "make promtool - unpack promtool (Prometheus' checker) into .cache/tools for the deploy tests"
	@echo "make nginx   - unpack nginx (Debian's package, no install, no root) into .cache/tools for the proxy tests"
	@echo "make bench   - the Flask-vs-Triton benchmark, about 10 min (bench/RESULTS.md; BENCH_ARGS=--help)"
	@echo "make bench-quick - the same in under 2 minutes (resnet18, fewer and shorter runs)"
	@echo "make bench-frontend - the shim's CPU per image with a near-free model: floor, legacy front, each transport, direct (about 5 min; BENCH_ARGS=--profile)"
	@echo "make bench-memory - a shim worker's peak memory under the worst input its limits accept (about 3 min)"

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else \
	  "Python 3.11 is required (the Triton wheel ships a python-backend stub per version); set PYTHON=python3.11")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch is pinned in pyproject.toml: an unpinned torch would download several GB
	$(PY) -m pip install --quiet -e '.[legacy,local-triton,dev]'
	touch $@

install: $(VENV)/.installed

# Re-run when the arch changes: the tool keeps a model.pt that already holds what was asked for.
export: install
	$(PY) tools/export_model.py --arch $(ARCH)

triton: export
	$(PY) -m app.embedded_triton --model-repository triton_repo

run: export
	$(PY) tools/run_local.py

# Bytecode caching on even where the environment turns it off (PYTHONDONTWRITEBYTECODE): the suite starts
# dozens of Python processes, and pytest would otherwise rewrite the asserts of ~400 plugin modules at every
# start (about 5 s of each run here). __pycache__ is gitignored.
test: export lint promtool nginx
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest $(PYTEST_ARGS)

# `docker compose up` for real: installs a docker engine, Compose v2 and debootstrap when missing, starts
# dockerd when none runs (and stops it after), builds the images from local bases and a wheelhouse, runs
# docker-compose.yml with tests/compose/ci.yml and checks it from the host (tools/compose_test.py).
.PHONY: compose-test
compose-test: install
	$(PY) tools/compose_test.py

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

bench-frontend: install
	$(PY) -m bench --frontend $(BENCH_ARGS)

bench-memory: export
	$(PY) -m bench --memory $(BENCH_ARGS)

lint: install
	$(PY) -m ruff check app tools tests bench gunicorn.conf.py
	$(PY) -m mypy

clean:
	rm -rf .cache .pytest_cache .mypy_cache .ruff_cache
	find triton_repo -name model.pt -delete -o -name labels.txt -delete -o -name __pycache__ -prune -exec rm -rf {} +
