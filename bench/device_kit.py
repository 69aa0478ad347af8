"""`bench/device_check.sh`'s measurement, for the day a GPU machine is lent (see the script's header for how).

One run, at most about 8 minutes on the lent host (one H200, 16 cores), writing one results file:

  model-only   resnet50 (seeded weights: real shapes and speed) in torch on the GPU, batch 1 to 64, and through
               Triton (the wheel's, KIND_GPU: the libtorch stand-in runs the TorchScript on the GPU) with
               ready-made FP32 batches
  decode       resnet50_decode on the GPU (nvImageCodec's nvJPEG, torch resize): images/s for 640x480 JPEGs,
               whether a truncated JPEG is refused, and the agreement with the legacy path on the generated
               corpus of efficientnet_lite0_decode (the same code, generated from EfficientNet-Lite0's description:
               bench/agreement.py, that model's top-1 and top-5 with its own preprocessing, the tensors' differences)
  shim         the shim under gunicorn on the host's cores, one row per transport (http, shm, uint8, encoded)
               at 16, 64 and 256 connections (bench/loadgen.py): images/s, p50/p99, CPU ms per image of the
               shim's and of Triton's processes (/proc)

--dry-run does all of it on a CPU machine at toy sizes (resnet18, batches 1-2, 4 connections, windows under a
second, a 12-upload corpus, one instance per model, KIND_CPU): `make test` runs it, so the kit is known to
work before a GPU is lent. A step that fails is recorded with its error and the others still run; the results
file is rewritten after every step, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODELS = ("resnet50", "normalize", "resnet50_uint8", "resnet50_decode", "resnet50_encoded")
TRANSPORTS = ("http", "shm", "uint8", "encoded")


@dataclass(frozen=True)
class Plan:
    arch: str
    batches: tuple[int, ...]
    connections: tuple[int, ...]
    warmup_s: float
    window_s: float
    decode_s: float
    corpus_limit: int | None
    gpu: bool
    instances: int | None  # None: the committed configs' counts
    shim_workers: int
    loadgen_processes: int
    near_free: bool = False  # Triton's resnet50 and normalize as numpy stand-ins (modelrepo/standin.py)


FULL = Plan(arch="resnet50", batches=(1, 2, 4, 8, 16, 32, 64), connections=(16, 64, 256), warmup_s=2.0, window_s=5.0,
            decode_s=8.0, corpus_limit=None, gpu=True, instances=None,
            shim_workers=max(2, len(os.sched_getaffinity(0)) // 2), loadgen_processes=4)
DRY = Plan(arch="resnet18", batches=(1, 2), connections=(4,), warmup_s=0.3, window_s=1.0, decode_s=1.0,
           corpus_limit=12, gpu=False, instances=1, shim_workers=1, loadgen_processes=1, near_free=True)


class Results:
    """One JSON file (and its markdown), rewritten after every step."""

    def __init__(self, out: Path, plan: Plan, dry: bool) -> None:
        self.out = out
        self.started = time.monotonic()
        self.data: dict[str, Any] = {"dry_run": dry, "plan": plan.__dict__, "machine": machine(), "steps": {},
                                     "errors": {}}

    def step(self, name: str, work: Callable[[], Any]) -> Any:
        print(f"device kit: {name} ...", flush=True)
        began = time.monotonic()
        try:
            value = work()
        except Exception as e:  # the kit's outermost frame per step: record it, go on with the next step
            self.data["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
            print(f"device kit: {name} FAILED: {type(e).__name__}: {e}", flush=True)
            value = None
        else:
            self.data["steps"][name] = value
        self.data.setdefault("seconds", {})[name] = round(time.monotonic() - began, 1)
        self.write()
        return value

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.started, 1)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "device_results.json").write_text(json.dumps(self.data, indent=2, default=str))
        (self.out / "device_results.md").write_text(markdown(self.data))


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "cores": len(os.sched_getaffinity(0)),
                            "platform": platform.platform()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception as e:  # a host without torch still gets its other figures
        info["torch"] = f"unavailable: {e}"
    return info


# -- the repository ---------------------------------------------------------------------------------------------

def build_repo(dest: Path, plan: Plan) -> Path:
    """triton_repo's five models of the kit, with a seeded `plan.arch` as resnet50 (max batch 64 for the
    model-only rows) and the normalize TorchScript, and the agreement's decode step, written into `dest` (never
    into triton_repo)."""
    from google.protobuf import text_format

    from devstack.cpu_repo import read_config
    from modelrepo.export import build_model, export_normalize, save_torchscript, write_labels
    from modelrepo.standin import write_standin_repo

    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    source = ROOT / "triton_repo"
    if plan.near_free:  # the dry run: numpy stand-ins with the same interfaces, no TorchScript to run on a CPU
        source = write_standin_repo(dest.parent / "standin", keep_torch_models=True)
    for name in MODELS:
        shutil.copytree(source / name, dest / name,
                        ignore=shutil.ignore_patterns("__pycache__", "model.pt", "labels.txt", "configs"))
        config = read_config(dest / name / "config.pbtxt")
        if name == "resnet50":
            config.max_batch_size = max(plan.batches[-1], config.max_batch_size)
            del config.dynamic_batching.preferred_batch_size[:]
            config.dynamic_batching.preferred_batch_size.extend(
                b for b in (8, 16, 32, 64) if b <= config.max_batch_size)
        for group in config.instance_group:
            if plan.instances is not None:
                group.count = plan.instances
        (dest / name / "config.pbtxt").write_text(text_format.MessageToString(config))
    # The agreement's decode step: the same code, with the reference model's own preprocessing (bench/agreement.py).
    from bench import agreement, reference_model

    step = agreement.write_decode_step(reference_model.reference(), dest)
    config = read_config(dest / step / "config.pbtxt")
    for group in config.instance_group:
        if plan.instances is not None:
            group.count = plan.instances
    (dest / step / "config.pbtxt").write_text(text_format.MessageToString(config))
    write_labels(plan.arch, dest / "resnet50" / "labels.txt")
    if not plan.near_free:
        (dest / "resnet50" / "1").mkdir(exist_ok=True)
        save_torchscript(build_model(plan.arch, None, 0), dest / "resnet50" / "1" / "model.pt",
                         {"arch": plan.arch, "seed": 0})
        export_normalize(dest)
    return dest


def start_triton(repo: Path, work: Path, plan: Plan) -> Any:
    from devstack import EmbeddedTriton, EmbeddedTritonConfig, launch

    ports = {launch.free_port() for _ in range(8)}
    http, grpc, metrics = sorted(ports)[:3]
    config = EmbeddedTritonConfig(model_repository=repo, cache_dir=work, http_port=http, grpc_port=grpc,
                                  metrics_port=metrics, startup_timeout_s=300, gpu=plan.gpu)
    return EmbeddedTriton(config).start()


def triton_pid(triton: Any) -> int:
    from bench import cpu

    port = f"--http-port={triton.config.http_port}"
    (pid,) = cpu.find_pids(lambda argv: Path(argv[0]).name == "tritonserver" and port in argv)
    return pid


# -- the steps --------------------------------------------------------------------------------------------------

def closed_loop(url: str, call: Callable[[Any], int], threads: int, seconds: float, warmup_s: float) -> dict[str, Any]:
    """`threads` threads calling call(client) in a loop (each returns the images it did): images/s."""
    import tritonclient.http as httpclient

    done = [0] * threads
    errors: list[str] = []
    start, stop = time.monotonic() + warmup_s, time.monotonic() + warmup_s + seconds

    def loop(i: int, url: str) -> None:
        client = httpclient.InferenceServerClient(url, network_timeout=120)
        try:
            while (now := time.monotonic()) < stop:
                n = call(client)
                if now >= start:
                    done[i] += n
        except Exception as e:  # one thread's failure is the row's error, not the kit's
            errors.append(f"{type(e).__name__}: {e}")
        finally:
            client.close()

    workers = [threading.Thread(target=loop, args=(i, url)) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return {"images_per_s": round(sum(done) / seconds, 1), "threads": threads, "errors": errors[:3]}


def model_only(triton: Any, plan: Plan) -> dict[str, Any]:
    import numpy as np
    import torch
    import tritonclient.http as httpclient

    from modelrepo.export import build_model

    out: dict[str, Any] = {"in_process": {}, "through_triton": {}}
    device = torch.device("cuda" if plan.gpu and torch.cuda.is_available() else "cpu")
    if plan.near_free:  # the dry run: the stand-in's arithmetic as scripted torch, not a network on a CPU
        from bench.frontend import near_free_torchscript

        model = torch.jit.load(str(near_free_torchscript(Path(tempfile.mkdtemp()) / "m.pt", (3, 224, 224), 1000)))
    else:
        model = build_model(plan.arch, None, 0).to(device).eval()
    with torch.inference_mode():
        for batch in plan.batches:
            x = torch.randn(batch, 3, 224, 224, device=device)
            for _ in range(3):
                model(x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            began, n = time.monotonic(), 0
            while time.monotonic() - began < plan.window_s / 2 or n < 2:
                model(x)
                n += 1
            if device.type == "cuda":
                torch.cuda.synchronize()
            out["in_process"][str(batch)] = round(n * batch / (time.monotonic() - began), 1)
    del model
    for batch in plan.batches:
        data = np.random.default_rng(batch).standard_normal((batch, 3, 224, 224)).astype(np.float32)

        def call(client: Any, data: Any = data) -> int:
            tensor = httpclient.InferInput("input__0", list(data.shape), "FP32")
            tensor.set_data_from_numpy(data, binary_data=True)
            client.infer("resnet50", [tensor])
            return int(data.shape[0])

        out["through_triton"][str(batch)] = closed_loop(triton.http_url, call, 4, plan.window_s / 2, plan.warmup_s)
    out["device"] = str(device)
    return out


def decode_step(triton: Any, plan: Plan) -> dict[str, Any]:
    import numpy as np
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    from bench import agreement, corpus, reference_model, stack

    jpegs = stack.sample_jpegs(16)
    counter = [0]

    def send(client: Any, model: str, data: bytes) -> Any:
        tensor = httpclient.InferInput("encoded", [1, len(data)], "UINT8")
        tensor.set_data_from_numpy(np.frombuffer(data, np.uint8).reshape(1, -1), binary_data=True)
        return client.infer(model, [tensor])

    def call(client: Any, model: str = "resnet50_decode") -> int:
        counter[0] += 1
        send(client, model, jpegs[counter[0] % len(jpegs)])
        return 1

    out: dict[str, Any] = {"jpeg": "640x480, quality 90 (bench/stack.sample_jpegs)"}
    clients = 32 if plan.gpu else 4
    out["decode_images_per_s"] = closed_loop(triton.http_url, call, clients, plan.decode_s, plan.warmup_s)
    out["encoded_ensemble_images_per_s"] = closed_loop(triton.http_url, lambda c: call(c, "resnet50_encoded"),
                                                       clients, plan.decode_s, plan.warmup_s)
    client = httpclient.InferenceServerClient(triton.http_url, network_timeout=120)
    corrupt = {"half": jpegs[0][: len(jpegs[0]) // 2], "no EOI": jpegs[0][:-2], "minus 100 bytes": jpegs[0][:-100]}
    refused = {}
    for name, data in corrupt.items():
        try:
            send(client, "resnet50_decode", data)
            refused[name] = False  # decoded anyway: the shim would answer 200 where the legacy app says 400
        except InferenceServerException as e:
            refused[name] = "[decode_refused]" in str(e)
    client.close()
    out["corrupt_jpegs_refused"] = refused
    reference = reference_model.reference()
    step = agreement.DecodeStep(triton.http_url, reference.decode_model)
    try:
        rows, summary = agreement.measure(corpus.cached(limit=plan.corpus_limit), step, reference,
                                          concurrency=16 if plan.gpu else 2)
    finally:
        step.close()
    out["agreement"] = summary
    out["agreement_rows"] = [r.__dict__ for r in rows if not r.same_top1 or r.max_levels > 1]
    out["instance_kinds"] = sorted({str(g.get("kind")) for g in step.instances})
    return out


def shim_rows(triton: Any, repo: Path, work: Path, plan: Plan) -> list[dict[str, Any]]:
    from bench import stack
    from bench.loadgen import Job, LoadGenerator, multipart_request
    from bench.report import summarize
    from devstack import launch

    jpegs = stack.sample_jpegs(16)
    tpid = triton_pid(triton)
    rows = []
    (work / "logs").mkdir(parents=True, exist_ok=True)
    shims = {}  # every transport's shim starts at once (they idle while another is measured)
    for transport in TRANSPORTS:
        env = {"SHIM_TRITON_URL": triton.http_url, "SHIM_MODE": "triton", "SHIM_TRANSPORT": transport,
               "SHIM_MODEL_REPOSITORY": str(repo), "SHIM_WORKERS": str(plan.shim_workers),
               "SHIM_LOG_LEVEL": "WARNING"}
        shims[transport] = launch.start_shim(work / "logs", env)
    with LoadGenerator(plan.loadgen_processes) as loadgen:
        for transport, served in shims.items():
            try:
                served.wait("/readyz", timeout_s=180)
                host, port = "127.0.0.1", served.port
                requests = tuple(multipart_request(host, port, "/predict", "image", f"p{i}.jpg", "image/jpeg", j)
                                 for i, j in enumerate(jpegs))
                for connections in plan.connections:
                    watch = (("shim", (served.process.pid,)), ("triton", (tpid,)))
                    job = Job(host=host, port=port, requests=requests, expect=b'"predictions"', concurrency=connections,
                              warmup_s=plan.warmup_s, duration_s=plan.window_s, timeout_s=60, watch=watch)
                    outcome = loadgen.run(job)
                    summary = summarize(outcome)
                    window = outcome.cpu_window or {}
                    good = summary["answers"] or 1
                    row = {"transport": transport, "connections": connections, "images_per_s": round(summary["qps"], 1),
                           "p50_ms": summary["p50_ms"], "p99_ms": summary["p99_ms"], "errors": summary["errors"],
                           "error_kinds": summary["error_kinds"],
                           "shim_cpu_ms_per_image": round(1000 * window.get("shim", {}).get("cpu_s", 0) / good, 3),
                           "triton_cpu_ms_per_image": round(1000 * window.get("triton", {}).get("cpu_s", 0) / good, 3),
                           "loadgen_cpu_ms_per_image": summary["loadgen_cpu_ms_per_request"]}
                    rows.append(row)
                    print(f"  shim [{transport}] c={connections}: {row['images_per_s']} images/s, shim CPU "
                          f"{row['shim_cpu_ms_per_image']} ms/img, Triton {row['triton_cpu_ms_per_image']}, "
                          f"{row['errors']} errors", flush=True)
            finally:
                served.stop(graceful=False)
    return rows


# -- the report -------------------------------------------------------------------------------------------------

def markdown(data: dict[str, Any]) -> str:
    m, steps = data["machine"], data["steps"]
    lines = [f"# Device check{' (dry run: toy sizes, no GPU)' if data['dry_run'] else ''}", "",
             f"Python {m.get('python')}, {m.get('cores')} cores, torch {m.get('torch')} (CUDA {m.get('cuda')}), "
             f"GPUs: {', '.join(m.get('gpus') or []) or 'none'}; {data.get('elapsed_s')} s.", ""]
    if "model_only" in steps:
        mo = steps["model_only"]
        lines += [f"## Model only ({data['plan']['arch']}, {mo['device']})", "", "| batch | in torch, images/s | "
                  "through Triton (4 clients), images/s |", "| --: | --: | --: |"]
        for b, v in mo["in_process"].items():
            lines.append(f"| {b} | {v} | {mo['through_triton'].get(b, {}).get('images_per_s')} |")
        lines.append("")
    if "decode" in steps:
        d = steps["decode"]
        a = d["agreement"]["all"]
        lines += ["## Decode on the device (resnet50_decode)", "",
                  f"- instances: {', '.join(d['instance_kinds'])}; {d['jpeg']}",
                  f"- decode step alone: {d['decode_images_per_s']['images_per_s']} images/s "
                  f"({d['decode_images_per_s']['threads']} clients); the encoded ensemble (decode + model): "
                  f"{d['encoded_ensemble_images_per_s']['images_per_s']} images/s",
                  f"- corrupt JPEGs refused: {d['corrupt_jpegs_refused']}",
                  f"- agreement with the legacy path ({d['agreement'].get('model', '?')}), {a['images']} uploads: "
                  f"top-1 {a['top1_agreement']:.2%}, mean "
                  f"top-5 overlap {a['top5_overlap']:.2%}, tensor max {a['max_levels']:.2f} / mean "
                  f"{a['mean_levels']:.4f} pixel levels ({'MET' if d['agreement']['met'] else 'NOT MET'}: targets "
                  f"99.5 % and 99 %)", ""]
    if "shim" in steps:
        lines += ["## The shim per transport", "", "| transport | connections | images/s | p50 ms | p99 ms | shim CPU "
                  "ms/img | Triton CPU ms/img | errors |", "| --- | --: | --: | --: | --: | --: | --: | --: |"]
        for r in steps["shim"]:
            lines.append(f"| {r['transport']} | {r['connections']} | {r['images_per_s']} | {_ms(r['p50_ms'])} | "
                         f"{_ms(r['p99_ms'])} | {r['shim_cpu_ms_per_image']} | {r['triton_cpu_ms_per_image']} | "
                         f"{r['errors']} |")
        lines.append("")
    for name, error in data["errors"].items():
        lines += [f"## FAILED: {name}", "", "```", error.strip(), "```", ""]
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.device_kit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="toy sizes on a CPU machine (make test runs this)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "bench" / "out" / "device"))
    args = p.parse_args(argv)
    plan = DRY if args.dry_run else FULL
    results = Results(args.out, plan, args.dry_run)
    work = Path(tempfile.mkdtemp(prefix="shim-device-"))
    triton = None
    try:
        repo = results.step("repository", lambda: str(build_repo(work / "repo", plan)))
        if repo is not None:
            triton = results.step("triton", lambda: start_triton(Path(repo), work / "triton", plan))
        if triton is not None:
            results.data["steps"]["triton"] = {"url": triton.http_url, "gpu": plan.gpu}
            results.step("model_only", lambda: model_only(triton, plan))
            results.step("decode", lambda: decode_step(triton, plan))
            results.step("shim", lambda: shim_rows(triton, Path(repo), work, plan))
    finally:
        if triton is not None:
            triton.stop(graceful=False)
        shutil.rmtree(work, ignore_errors=True)
        results.write()
    print((args.out / "device_results.md").read_text())
    print(f"device kit: wrote {args.out / 'device_results.json'} and device_results.md", flush=True)
    return 1 if results.data["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
