#!/usr/bin/env bash
# The benchmark against the docker compose deployment on a GPU host: the article's setting.
#
#   docker compose --profile export run --rm --user "$(id -u):$(id -g)" model-export   # once: model.pt
#   docker compose up -d                                                               # Triton + shim
#   bench/gpu_host.sh                        # or: bench/gpu_host.sh --duration 60 --concurrency 1,8,32,64
#
# What it measures, with the same load generator and report as `make bench`:
#   (0) direct      ready-made tensors straight to the compose Triton (TRITON_URL): the ceiling
#   (3) batching    the compose shim (SHIM_URL) -> that Triton, with the config it serves (triton_repo as committed:
#                   2 GPU instances, dynamic batching); the report shows the config read back from Triton
#   (1) legacy      examples/legacy_app.py started here, one process; as written it runs the model on the CPU,
#                   so it is not the article's GPU Flask app: pass LEGACY_URL=http://host:port to measure yours
# (2) needs a Triton serving the model without dynamic batching and is skipped: the compose Triton serves its
# own config. Extra arguments go to `python -m bench` (see `python -m bench --help`).
#
# Then the front-end rows (`python -m bench --frontend`, FRONTEND=0 skips them): they do not use the compose
# stack. They start their own servers on this host, on free loopback ports: a local Triton from the
# nvidia-pytriton wheel serving a near-free numpy stand-in of resnet50 (written into the run's folder), the
# shim (its default workers and threads) once per transport, and the legacy app (gunicorn 2 x 8) with a near-free
# TorchScript model, plus the decode + preprocess floor; so they measure this host's CPU cost per image, the
# part that decides how many images reach a GPU. Stop the compose stack first for a quiet host
# (`docker compose stop`), or read them as measured beside it. FRONTEND_ARGS go to that run
# (e.g. FRONTEND_ARGS="--profile --duration 30").
# Results: bench/out/<time>-<arch>/ and bench/out/<time>-frontend/, results.{md,json}. Needs Python 3.11 and
# make on the host.
set -euo pipefail
cd "$(dirname "$0")/.."

TRITON_URL="${TRITON_URL:-localhost:8000}"
SHIM_URL="${SHIM_URL:-http://localhost:5000}"
TRITON_METRICS_URL="${TRITON_METRICS_URL:-http://${TRITON_URL%:*}:8002/metrics}"
LEGACY_URL="${LEGACY_URL:-}"
FRONTEND="${FRONTEND:-1}"
read -r -a frontend_args <<< "${FRONTEND_ARGS:-}"

make install  # the virtualenv with torch (legacy app, model export), tritonclient, tqdm, matplotlib

wait_ready() {  # url what
  for _ in $(seq 1 90); do
    if .venv/bin/python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=3)" "$1" \
        2>/dev/null; then
      return 0
    fi
    sleep 2
  done
  echo "gpu_host.sh: $2 is not ready at $1 after 3 minutes (is \`docker compose up -d\` running?)" >&2
  exit 1
}
wait_ready "http://${TRITON_URL}/v2/health/ready" "Triton"
wait_ready "${SHIM_URL}/readyz" "the shim"

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

args=(--triton-url "$TRITON_URL" --triton-metrics-url "$TRITON_METRICS_URL" --shim-url "$SHIM_URL" --arch resnet50)
if [[ -n "$LEGACY_URL" ]]; then
  args+=(--legacy-url "$LEGACY_URL")
fi
status=0
.venv/bin/python -m bench "${args[@]}" "$@" || status=$?
if [[ "$FRONTEND" != 0 ]]; then
  .venv/bin/python -m bench --frontend "${frontend_args[@]}" || status=$?
fi
exit "$status"
