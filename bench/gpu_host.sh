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
# Results: bench/out/<time>-<arch>/results.{md,json,png}. Needs Python 3.11 and make on the host.
set -euo pipefail
cd "$(dirname "$0")/.."

TRITON_URL="${TRITON_URL:-localhost:8000}"
SHIM_URL="${SHIM_URL:-http://localhost:5000}"
TRITON_METRICS_URL="${TRITON_METRICS_URL:-http://${TRITON_URL%:*}:8002/metrics}"
LEGACY_URL="${LEGACY_URL:-}"

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
exec .venv/bin/python -m bench "${args[@]}" "$@"
