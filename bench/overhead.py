"""What the shim costs on top of Triton, measured side by side in one run on this machine.

    python bench/overhead.py [--seconds 15] [--clients 16] [--repeat 200]

1. Preprocessing per 640x480 JPEG on one core: decode, the shim's tensor path, and the legacy app's
   torchvision transforms for comparison (the same tensor, checked).
2. Shim overhead at concurrency 1: POST /predict through the shim against a direct tritonclient call
   with a ready-made tensor, interleaved request by request against the same Triton.
3. Throughput at N clients: the shim against direct tritonclient, alternating runs, same Triton.

It starts its own Triton (the wheel's, on free ports) and its own shim (gunicorn, its default workers and threads)
on triton_repo/ as `make export` left it. Numbers are medians; read the ratios, not the absolutes.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app.preprocess import ImageSpec, decode, to_tensor  # noqa: E402
from bench import stack  # noqa: E402
from devstack import launch  # noqa: E402
from modelrepo.export import read_export_info  # noqa: E402
from report.percentiles import median  # noqa: E402
from tests.sample_images import encode, photo  # noqa: E402


def timed(work, repeat: int) -> list[float]:  # type: ignore[no-untyped-def]
    work()
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        work()
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def preprocessing(jpeg: bytes, repeat: int) -> dict[str, float]:
    import torch
    from PIL import Image
    from torchvision import transforms

    torch.set_num_threads(1)
    spec = ImageSpec()
    reference = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(),
                                    transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    image = decode(jpeg, spec)
    diff = float(np.abs(to_tensor(image, spec) - reference(image).numpy()).max())
    result = {
        "decode_ms": median(timed(lambda: decode(jpeg, spec), repeat)),
        "shim_tensor_ms": median(timed(lambda: to_tensor(image, spec), repeat)),
        "torchvision_tensor_ms": median(timed(lambda: reference(image), repeat)),
        "legacy_decode_ms": median(timed(lambda: Image.open(io.BytesIO(jpeg)).convert("RGB"), repeat)),
        "max_abs_diff": diff,
    }
    result["shim_total_ms"] = result["decode_ms"] + result["shim_tensor_ms"]
    return result


def concurrency_one(shim_url: str, triton_url: str, jpeg: bytes, tensor: np.ndarray, repeat: int) -> dict:
    import requests
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(triton_url)
    session = requests.Session()
    inp = httpclient.InferInput("input__0", list(tensor.shape), "FP32")
    inp.set_data_from_numpy(tensor, binary_data=True)

    def direct() -> None:
        client.infer("resnet50", [inp])

    def shim() -> None:
        response = session.post(shim_url + "/predict", files={"image": ("x.jpg", jpeg)})
        response.raise_for_status()

    for _ in range(10):
        direct()
        shim()
    direct_ms, shim_ms = [], []
    for _ in range(repeat):  # interleaved: both see the same machine, request by request
        direct_ms += timed(direct, 1)
        shim_ms += timed(shim, 1)
    client.close()
    paired = [s - d for s, d in zip(shim_ms, direct_ms, strict=True)]
    return {"direct_p50_ms": median(direct_ms), "shim_p50_ms": median(shim_ms),
            "overhead_p50_ms": median(paired), "samples": repeat}


def throughput(clients: int, seconds: float, make_worker) -> float:  # type: ignore[no-untyped-def]
    stop, counts, errors = threading.Event(), [0] * clients, [0]

    def run(i: int) -> None:
        send = make_worker()
        while not stop.is_set():
            try:
                send()
                counts[i] += 1
            except Exception:
                errors[0] += 1

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    if errors[0]:
        raise RuntimeError(f"{errors[0]} requests failed during the throughput run")
    return sum(counts) / seconds


def throughput_pair(shim_url: str, triton_url: str, jpeg: bytes, tensor: np.ndarray, clients: int,
                    seconds: float, rounds: int = 2) -> dict:
    import requests
    import tritonclient.http as httpclient

    def direct_worker():  # type: ignore[no-untyped-def]
        client = httpclient.InferenceServerClient(triton_url)
        inp = httpclient.InferInput("input__0", list(tensor.shape), "FP32")
        inp.set_data_from_numpy(tensor, binary_data=True)
        return lambda: client.infer("resnet50", [inp])

    def shim_worker():  # type: ignore[no-untyped-def]
        session = requests.Session()

        def send() -> None:
            session.post(shim_url + "/predict", files={"image": ("x.jpg", jpeg)}).raise_for_status()
        return send

    throughput(clients, 3, shim_worker)  # warm every worker thread and connection
    direct, shim = [], []
    for _ in range(rounds):
        direct.append(throughput(clients, seconds, direct_worker))
        shim.append(throughput(clients, seconds, shim_worker))
    return {"direct_rps": statistics.mean(direct), "shim_rps": statistics.mean(shim),
            "ratio": statistics.mean(shim) / statistics.mean(direct), "rounds": rounds, "seconds": seconds}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", type=Path, default=ROOT / "triton_repo")
    p.add_argument("--seconds", type=float, default=15)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--repeat", type=int, default=200)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "overhead.json")
    args = p.parse_args()

    jpeg = encode(photo(640, 480, seed=1), "JPEG", quality=90)
    tensor = to_tensor(decode(jpeg, ImageSpec()), ImageSpec())[None]
    print("1/3 preprocessing, one core ...", flush=True)
    pre = preprocessing(jpeg, args.repeat * 2)

    work = Path(tempfile.mkdtemp(prefix="shim-bench-"))
    triton = stack.start_triton(args.repo, work / "triton")
    shim = launch.start_shim(work, {"SHIM_TRITON_URL": triton.http_url,
                                    "SHIM_LOG_LEVEL": "WARNING",
                                    "SHIM_MODEL_REPOSITORY": str(args.repo)})
    try:
        shim.wait("/readyz")
        print("2/3 concurrency 1, shim and direct interleaved ...", flush=True)
        one = concurrency_one(shim.url, triton.http_url, jpeg, tensor, args.repeat)
        print(f"3/3 {args.clients} clients, {args.seconds:.0f} s per run, alternating ...", flush=True)
        many = throughput_pair(shim.url, triton.http_url, jpeg, tensor, args.clients, args.seconds)
    finally:
        shim.stop()
        triton.stop()

    report = {"machine": stack.machine_info(),
              "model": json.dumps(read_export_info(args.repo / "resnet50" / "1" / "model.pt")),
              "preprocessing": pre, "concurrency_1": one, f"clients_{args.clients}": many}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"""
model: {report['model']}
preprocessing, 640x480 JPEG, one core (median):
  decode {pre['decode_ms']:.2f} ms + shim tensor {pre['shim_tensor_ms']:.2f} ms = {pre['shim_total_ms']:.2f} ms
  (legacy torchvision tensor {pre['torchvision_tensor_ms']:.2f} ms; max abs diff {pre['max_abs_diff']:.1e})
concurrency 1 (median of {one['samples']}):
  direct tritonclient {one['direct_p50_ms']:.1f} ms, shim {one['shim_p50_ms']:.1f} ms,
  shim overhead {one['overhead_p50_ms']:.1f} ms per request (target <= 5 ms)
{args.clients} clients:
  direct {many['direct_rps']:.1f} req/s, shim {many['shim_rps']:.1f} req/s, ratio {many['ratio']:.2f} (target >= 0.9)
written to {args.out}""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
