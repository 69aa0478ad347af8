"""Warm before ready, measured: the first request after a hot reload, with and without model_warmup.

    python -m bench.warmup                 # resnet50, 3 reloads per configuration
    python -m bench.warmup --arch resnet18 --reloads 2

Two Tritons (the embedded server, one after the other) serve triton_repo's resnet50 config: as committed
(with model_warmup) and the same config without it. For each, the tool hot-reloads a new version folder
`--reloads` times (POST /v2/repository/models/resnet50/load, as an operator would) and times the first
request after each load call returns, then ten more. Nothing is written into triton_repo/.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import stack
from devstack.waiting import wait_until
from report.percentiles import median

ROWS = ("with model_warmup (as committed)", "without model_warmup")


def variant(dest: Path, model_pt: Path, warm: bool) -> Path:
    from google.protobuf import text_format

    from devstack.cpu_repo import read_config
    from modelrepo.export import write_labels

    config = read_config(stack.TRITON_REPO / "resnet50" / "config.pbtxt")
    if not config.model_warmup:
        raise SystemExit("triton_repo/resnet50/config.pbtxt has no model_warmup: nothing to compare")
    if not warm:
        config.ClearField("model_warmup")
    model_dir = dest / "resnet50"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(text_format.MessageToString(config))
    (model_dir / "1" / "model.pt").symlink_to(model_pt.resolve())
    write_labels("resnet50", model_dir / "labels.txt")
    return dest


def measure(repo: Path, work: Path, model_pt: Path, reloads: int) -> tuple[list[float], list[float]]:
    import tritonclient.http as httpclient

    triton = stack.start_triton(repo, work)
    client = httpclient.InferenceServerClient(triton.http_url, network_timeout=300)
    image = np.random.default_rng(0).standard_normal((1, 3, 224, 224), dtype=np.float32)

    def once() -> float:
        tensor = httpclient.InferInput("input__0", list(image.shape), "FP32")
        tensor.set_data_from_numpy(image, binary_data=True)
        started = time.perf_counter()
        client.infer("resnet50", [tensor])
        return (time.perf_counter() - started) * 1000

    firsts, steady = [], []
    try:
        for reload in range(reloads):
            version = repo / "resnet50" / str(reload + 2)
            version.mkdir()
            (version / "model.pt").symlink_to(model_pt.resolve())  # a new version folder: a real reload
            wait_until(lambda v=version.name: (triton.cpu_repo / "resnet50" / v / "model.py").is_file(), 30,
                       "the CPU copy to follow the new version")
            client.load_model("resnet50", headers=triton.config.admin_headers)  # the key, if Triton has one
            firsts.append(once())
            steady += [once() for _ in range(10)]
            print(f"  reload {reload + 1}: first request {firsts[-1]:.0f} ms, then median "
                  f"{median(steady[-10:]):.0f} ms", flush=True)
    finally:
        client.close()
        triton.stop()
    return firsts, steady


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.warmup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="resnet50", choices=("resnet18", "resnet50"))
    p.add_argument("--reloads", type=int, default=3)
    args = p.parse_args(argv)
    model_pt = stack.exported_model(args.arch)
    results = {}
    with tempfile.TemporaryDirectory(prefix="shim-warmup-") as tmp:
        for row, warm in zip(ROWS, (True, False), strict=True):
            print(f"{row}:", flush=True)
            repo = variant(Path(tmp) / ("warm" if warm else "cold") / "repo", model_pt, warm)
            results[row] = measure(repo, Path(tmp) / ("warm" if warm else "cold") / "work", model_pt, args.reloads)
    print(f"\n| {args.arch}, {args.reloads} hot reloads | first request after the load (median) | "
          "the next 10 (median) | first / next |\n|---|--:|--:|--:|")
    for row, (firsts, steady) in results.items():
        first, rest = median(firsts), median(steady)
        print(f"| {row} | {first:.0f} ms | {rest:.0f} ms | {first / rest:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
