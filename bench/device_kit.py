"""`bench/device_check.sh`'s measurement on a lent GPU machine, in three stages (the script's header says how):
a, ldd of the wheel's server, backend and stub; b, numpy, torch and CUDA in the python backend's environment;
c, the repository generated from the descriptions, the wheel's Triton on it, a smoke check, then the shim per
transport (encoded first), the decode step (with the agreement) and the model alone: the order of what issue 29
needs most, so that a call the device's time limit cuts short has lost the least. Each step's figures or error go
into the results file as soon as it has them. --dry-run: every stage on a CPU, the GPU plan's shapes, a near-free model.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
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

TRANSPORTS = ("encoded", "fp32", "uint8")  # encoded first: the route of the GPU-host target
DESCRIBED = "resnet50"  # the model the shim serves, exactly as its description says
BENCH = "kit_resnet50_b64"  # the kit's own copy of it for the model-only rows: max_batch_size 64
RESULTS = "device_results.json"
SECTIONS = ("libraries", "python_env", "repository", "triton", "smoke", "shim", "decode", "model_only")


@dataclass(frozen=True)
class Plan:
    arch: str
    batches: tuple[int, ...]
    connections: tuple[int, ...]
    warmup_s: float
    window_s: float
    decode_s: float
    gpu: bool
    shim_workers: int
    loadgen_processes: int
    near_free: bool = False  # Triton's models as numpy stand-ins (modelrepo/standin.py)


BATCHES = (1, 2, 4, 8, 16, 32, 64)
CONNECTIONS = (16, 64, 256)
FULL = Plan(arch="resnet50", batches=BATCHES, connections=CONNECTIONS, warmup_s=2.0, window_s=5.0,
            decode_s=8.0, gpu=True, shim_workers=max(2, len(os.sched_getaffinity(0)) // 2), loadgen_processes=4)
# The dry run's connections are scaled to 2 cores and one shim worker (256 there are answered 503 overloaded).
DRY = Plan(arch="resnet18", batches=BATCHES, connections=(4, 8, 16), warmup_s=0.2, window_s=0.6, decode_s=0.6,
           gpu=False, shim_workers=1, loadgen_processes=1, near_free=True)


class Results:
    """One JSON file (and its markdown), rewritten after every step."""

    def __init__(self, out: Path, plan: Plan, dry: bool, keep: Path | None = None) -> None:
        self.out, self.keep = out, keep
        self.started = time.monotonic()
        self.data: dict[str, Any] = {"dry_run": dry, "plan": plan.__dict__, "machine": machine(), "steps": {},
                                     "errors": {}}
        earlier = keep / RESULTS if keep else None
        if earlier and earlier.is_file():  # the earlier calls' sections (stages a and b), kept on the machine
            old = json.loads(earlier.read_text())
            self.data["steps"].update(old.get("steps", {}))
            self.data["errors"].update(old.get("errors", {}))

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
        text = json.dumps(self.data, indent=2, default=str)
        for folder in filter(None, (self.out, self.keep)):
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / (RESULTS + ".tmp")
            tmp.write_text(text)
            tmp.replace(folder / RESULTS)  # a run killed mid-write still leaves the last whole file
        (self.out / "device_results.md").write_text(markdown(self.data))

    def note(self, name: str, value: Any) -> None:
        """A figure of a step still running, written at once (a run cut short keeps it)."""
        self.data.setdefault("partial", {})[name] = value
        self.write()


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


def libraries() -> dict[str, Any]:
    """ldd of every binary the server loads from the wheel, in the environment the server starts with (this
    Python's LIBDIR on LD_LIBRARY_PATH, as devstack adds it): each "not found" line, named by its file."""
    from devstack.wheel import find_wheel, server_environment

    wheel = find_wheel()
    env = server_environment()
    files = [wheel.binary, wheel.python_backend / "libtriton_python.so", wheel.stub,
             *sorted(wheel.caches.rglob("*.so"))]
    out: dict[str, Any] = {"wheel": str(wheel.root), "checked": [str(f) for f in files], "not_found": {},
                           "LD_LIBRARY_PATH": env.get("LD_LIBRARY_PATH", "")}
    for f in files:
        if not f.is_file():
            out["not_found"][str(f)] = ["(the file itself is missing)"]
            continue
        run = subprocess.run(["ldd", str(f)], capture_output=True, text=True, timeout=60, env=env)
        missing = [line.strip() for line in (run.stdout + run.stderr).splitlines() if "not found" in line]
        if missing:
            out["not_found"][str(f)] = missing
    for name, lines in out["not_found"].items():
        print(f"  ldd {name}: " + "; ".join(lines), flush=True)
    if out["not_found"]:
        raise RuntimeError(f"shared libraries not found: {json.dumps(out['not_found'])}")
    return out


PROBE = """
import json, sys
out = {"python": sys.version.split()[0], "executable": sys.executable}
import numpy
out["numpy"] = numpy.__version__
import torch
out["torch"], out["torch_cuda"] = torch.__version__, torch.version.cuda
out["cuda_available"] = torch.cuda.is_available()
if out["cuda_available"]:
    torch.cuda.init()
    out["device"] = torch.cuda.get_device_name(0)
    out["allocated"] = float(torch.ones(1024, device="cuda").sum().item())
print(json.dumps(out))
"""


def python_env(plan: Plan) -> dict[str, Any]:
    """numpy, torch and CUDA in the python3 the python backend's stub embeds, with the server's environment."""
    from devstack.wheel import server_environment

    env = server_environment()
    python3 = shutil.which("python3", path=env["PATH"]) or "python3"
    run = subprocess.run([python3, "-c", PROBE], capture_output=True, text=True, env=env, timeout=180)
    if run.returncode != 0:
        raise RuntimeError(f"{python3} in the python backend's environment: {run.stderr.strip()[-2000:]}")
    out: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    out["LD_LIBRARY_PATH"] = env.get("LD_LIBRARY_PATH", "")
    print(f"  python backend's env: {out}", flush=True)
    if int(out["numpy"].split(".")[0]) >= 2:  # the wheel's server is Triton 2.51 (NGC 24.10): pybind11 2.10
        raise RuntimeError(f"numpy {out['numpy']} in the python backend's environment: Triton 2.51's stub cannot "
                           "read numpy 2 tensors (install numpy<2 into the kit's venv: stage b's numpy 1.26.4)")
    if plan.gpu and not out["cuda_available"]:
        raise RuntimeError(f"CUDA is not available to torch {out['torch']} in the python backend's environment: "
                           f"{json.dumps(out)}")
    return out


def bench_description(root: Path, dest: Path) -> Any:
    """resnet50's description under the kit's name with max_batch_size 64, for the model-only rows."""
    from app.description import load

    text = (root / "triton_repo" / DESCRIBED / "model.toml").read_text()
    lines = []
    for line in text.splitlines():
        key = line.split("=")[0].strip()
        if key == "name":
            line = f'name = "{BENCH}"'
        elif key == "max_batch_size":
            line = f"max_batch_size = {BATCHES[-1]}"
        lines.append(line)
    (dest / BENCH).mkdir(parents=True)
    (dest / BENCH / "model.toml").write_text("# bench/device_kit.py: resnet50's description for batches up to 64\n"
                                            + "\n".join(lines) + "\n")
    return load(dest / BENCH / "model.toml")


def build_repo(dest: Path, plan: Plan, root: Path = ROOT) -> Path:
    """triton_repo, generated from its descriptions here, models exported, the bench model beside it; checked."""
    from app.description import load
    from devstack.cpu_repo import model_dirs
    from modelrepo import generate
    from modelrepo.export import build_model, export_normalize, save_torchscript, write_labels

    if dest.exists():
        shutil.rmtree(dest)
    built = dest.parent / "generated"
    shutil.rmtree(built, ignore_errors=True)
    shutil.copytree(root / "triton_repo", built, ignore=shutil.ignore_patterns("__pycache__"))
    described = [load(d / "model.toml") for d in model_dirs(built).values() if (d / "model.toml").is_file()]
    for description in described:
        generate.write(description, built)
        write_labels(plan.arch, built / description.name / "labels.txt")
    bench = bench_description(root, built)
    for rel, text in generate.the_model(bench).items():
        (built / rel).parent.mkdir(parents=True, exist_ok=True)
        (built / rel).write_text(text)
    write_labels(plan.arch, built / BENCH / "labels.txt")
    from bench import agreement, reference_model  # the agreement's decode step, with its model's preprocessing

    agreement.write_decode_step(reference_model.reference(), built)
    if plan.near_free:  # numpy stand-ins with the same interfaces; the decode steps run as generated
        from modelrepo.standin import REPLACEMENTS, write_standin_repo

        write_standin_repo(dest, built, plan.arch, {**REPLACEMENTS, BENCH: REPLACEMENTS[DESCRIBED]},
                           keep_torch_models=True)
    else:
        shutil.copytree(built, dest)
        for name in (DESCRIBED, BENCH):
            (dest / name / "1").mkdir(exist_ok=True)
            save_torchscript(build_model(plan.arch, None, 0), dest / name / "1" / "model.pt",
                             {"arch": plan.arch, "seed": 0})
        export_normalize(dest)
    check_repo(dest)
    return dest


def check_repo(repo: Path) -> None:
    """The embedded server's own check of a repository's files (devstack.cpu_repo.check_model_files)."""
    from devstack.cpu_repo import check_model_files

    check_model_files(repo)


def start_triton(repo: Path, work: Path, plan: Plan) -> Any:
    from bench import stack

    return stack.start_triton(repo, work, plan.gpu, startup_timeout_s=300)


def closed_loop(url: str, call: Callable[[Any], int], threads: int, seconds: float, warmup_s: float) -> dict[str, Any]:
    """`threads` threads calling call(client) (the images it did): images/s of the calls begun after the warmup;
    a thread goes on past the window until it has finished one (a large batch may outlast a short window)."""
    import tritonclient.http as httpclient

    done = [0] * threads
    last = [0.0] * threads
    errors: list[str] = []
    start = time.monotonic() + warmup_s
    stop = start + seconds

    def loop(i: int, url: str) -> None:
        client = httpclient.InferenceServerClient(url, network_timeout=120)
        try:
            while (began := time.monotonic()) < stop or (done[i] == 0 and began < stop + 60):
                n = call(client)
                if began >= start:
                    done[i] += n
                    last[i] = time.monotonic()
        except Exception as e:  # one thread's failure is the row's error, not the kit's
            errors.append(f"{type(e).__name__}: {e}")
        finally:
            client.close()

    workers = [threading.Thread(target=loop, args=(i, url)) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    elapsed = max(max(last) - start, seconds) if any(done) else seconds
    return {"images_per_s": round(sum(done) / elapsed, 1), "threads": threads, "errors": errors[:3]}


def model_only(triton: Any, plan: Plan, results: Results) -> dict[str, Any]:
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
            results.note("model_only", out)
    del model
    for batch in plan.batches:
        data = np.random.default_rng(batch).standard_normal((batch, 3, 224, 224)).astype(np.float32)

        def call(client: Any, data: Any = data) -> int:
            tensor = httpclient.InferInput("input__0", list(data.shape), "FP32")
            tensor.set_data_from_numpy(data, binary_data=True)
            client.infer(BENCH, [tensor])
            return int(data.shape[0])

        out["through_triton"][str(batch)] = closed_loop(triton.http_url, call, 4, plan.window_s / 2, plan.warmup_s)
        results.note("model_only", out)
    out["device"] = str(device)
    return out


def smoke(triton: Any, plan: Plan) -> dict[str, Any]:
    """One JPEG through the decode step in this process (device, dtype, shape) and through Triton, vs the CPU path."""
    import importlib.util

    import numpy as np
    import torch
    import tritonclient.http as httpclient

    from app.description import load
    from app.preprocess import ImageSpec, decode, to_tensor
    from bench import stack

    description = load(Path(triton.config.model_repository) / DESCRIBED / "model.toml")
    jpeg = stack.sample_jpegs(1)[0]
    out: dict[str, Any] = {"jpeg_bytes": len(jpeg)}
    spec = importlib.util.spec_from_file_location("kit_decode", ROOT / "modelrepo" / "triton_models" / "decode.py")
    assert spec is not None and spec.loader is not None
    step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step)
    from nvidia import nvimgcodec

    device = torch.device("cuda" if plan.gpu and torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        decoder = nvimgcodec.Decoder(device_id=0, options=":fancy_upsampling=1")
    else:
        decoder = nvimgcodec.Decoder(device_id=nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY,
                                     backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.CPU_ONLY)])
    image = decoder.decode(np.frombuffer(jpeg, np.uint8),
                           params=nvimgcodec.DecodeParams(apply_exif_orientation=False,
                                                          color_spec=nvimgcodec.ColorSpec.SRGB))
    on_device = "DEVICE" in str(getattr(image, "buffer_kind", ""))
    hwc = torch.as_tensor(image, device=device) if on_device else torch.from_numpy(np.asarray(image)).to(device)
    tensor = step.Transform(description.decode_parameters(), device)(hwc)
    out["in_process"] = {"device": str(tensor.device), "dtype": str(tensor.dtype), "shape": list(tensor.shape),
                         "decoded_on": "device" if on_device else "host"}
    client = httpclient.InferenceServerClient(triton.http_url, network_timeout=120)
    try:
        sent = httpclient.InferInput("encoded", [1, 1], "BYTES")  # one upload per row, as the shim batches them
        sent.set_data_from_numpy(np.array([[jpeg]], dtype=object), binary_data=True)
        got = client.infer(description.decode_model, [sent]).as_numpy("decoded")
        cpu = to_tensor(decode(jpeg, ImageSpec.of(description)), ImageSpec.of(description))
        std = np.asarray(description.std, np.float32).reshape(3, 1, 1)
        levels = np.abs(np.asarray(got).reshape(cpu.shape) - cpu) * std * 255
        out["through_triton"] = {"dtype": str(got.dtype), "shape": list(got.shape),
                                 "max_levels": round(float(levels.max()), 3),
                                 "mean_levels": round(float(levels.mean()), 4)}
        answers = {}
        for model, tensor_in in (("encoded", sent), ("tensor", None)):
            if tensor_in is None:
                tensor_in = httpclient.InferInput("input__0", [1, *cpu.shape], "FP32")
                tensor_in.set_data_from_numpy(cpu[None].astype(np.float32), binary_data=True)
            name = description.encoded_model if model == "encoded" else DESCRIBED
            answers[model] = client.infer(name, [tensor_in]).as_numpy("output__0").reshape(-1)
        out["answer"] = {"top1_encoded": int(answers["encoded"].argmax()),
                         "top1_cpu_path": int(answers["tensor"].argmax()),
                         "max_logit_diff": round(float(np.abs(answers["encoded"] - answers["tensor"]).max()), 6)}
    finally:
        client.close()
    print(f"  smoke: {out}", flush=True)
    if out["answer"]["top1_encoded"] != out["answer"]["top1_cpu_path"]:
        raise RuntimeError(f"the encoded path's answer differs from the CPU path's: {out}")
    return out


def decode_step(triton: Any, plan: Plan) -> dict[str, Any]:
    import tritonclient.http as httpclient

    from bench import agreement, corpus, reference_model, stack

    jpegs = stack.sample_jpegs(16)
    counter = [0]

    def send(client: Any, model: str, data: bytes) -> Any:
        return client.infer(model, [agreement.bytes_input(httpclient, "encoded", data)])

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
        # readable: decoded anyway, where the shim would answer 200 and the legacy app says 400
        refused[name] = not bool(send(client, "resnet50_decode", data).as_numpy("readable")[0, 0])
    client.close()
    out["corrupt_jpegs_refused"] = refused
    reference = reference_model.reference()
    step = agreement.DecodeStep(triton.http_url, reference.decode_model)
    try:
        rows, summary = agreement.measure(corpus.cached(), step, reference,
                                          concurrency=16 if plan.gpu else 2)
    finally:
        step.close()
    out["agreement"] = summary
    out["shadow_tolerance"] = shadow_tolerance(summary)
    out["agreement_rows"] = [r.__dict__ for r in rows if not r.same_top1 or r.max_levels > 1]
    out["instance_kinds"] = sorted({str(g.get("kind")) for g in step.instances})
    return out


def shadow_tolerance(summary: dict[str, Any]) -> dict[str, Any]:
    """SHIM_SHADOW_TOLERANCE for the encoded transport: the largest score difference from the legacy path over
    the forwarded corpus, doubled and rounded up to one digit (the decoder's own difference is no mismatch)."""
    import math

    figures = summary.get("forwarded") or summary["all"]
    worst = float(figures["max_score_diff"])
    if worst <= 0:
        return {"max_score_diff": 0.0, "suggested": None}
    digits = math.floor(math.log10(2 * worst))
    suggested = math.ceil(2 * worst / 10 ** digits) * 10 ** digits
    return {"max_score_diff": worst, "p99_score_diff": figures["p99_score_diff"],
            "uploads": figures["images"], "suggested": float(f"{suggested:.1g}")}


def shim_rows(triton: Any, repo: Path, work: Path, plan: Plan, results: Results) -> list[dict[str, Any]]:
    from bench import stack
    from bench.loadgen import Job, LoadGenerator, multipart_request
    from bench.report import summarize
    from devstack import launch

    jpegs = stack.sample_jpegs(16)
    tpid = stack.triton_pid(triton)
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
                    results.note("shim", rows)
                    print(f"  shim [{transport}] c={connections}: {row['images_per_s']} images/s, shim CPU "
                          f"{row['shim_cpu_ms_per_image']} ms/img, Triton {row['triton_cpu_ms_per_image']}, "
                          f"{row['errors']} errors", flush=True)
            finally:
                served.stop(graceful=False)
    return rows


def markdown(data: dict[str, Any]) -> str:
    m, steps = data["machine"], data["steps"]
    lines = [f"# Device check{' (dry run: toy sizes, no GPU)' if data['dry_run'] else ''}", "",
             f"Python {m.get('python')}, {m.get('cores')} cores, torch {m.get('torch')} (CUDA {m.get('cuda')}), "
             f"GPUs: {', '.join(m.get('gpus') or []) or 'none'}; {data.get('elapsed_s')} s.", ""]
    if "libraries" in steps:
        lines += [f"- libraries: {len(steps['libraries']['checked'])} files checked with ldd, none missing"]
    if "python_env" in steps:
        env = steps["python_env"]
        lines += [f"- python backend's environment: Python {env['python']}, numpy {env['numpy']}, torch {env['torch']}"
                  f" (CUDA {env['torch_cuda']}), CUDA available: {env['cuda_available']} {env.get('device', '')}"]
    if "smoke" in steps:
        lines += [f"- smoke: {json.dumps(steps['smoke'])}", ""]
    if "shim" in steps:  # first: issue 29's figure; the last column is what the host's cores allow at that CPU
        cores = m.get("cores") or 0
        lines += ["## The shim per transport", "", "| transport | connections | images/s | p50 ms | p99 ms | shim CPU "
                  f"ms/img | Triton CPU ms/img | errors | {cores} cores / (shim + Triton CPU), images/s |",
                  "| --- | --: | --: | --: | --: | --: | --: | --: | --: |"]
        for r in steps["shim"]:
            host_ms = r["shim_cpu_ms_per_image"] + r["triton_cpu_ms_per_image"]
            allowed = f"{cores * 1000 / host_ms:,.0f}" if host_ms > 0 and cores else "-"
            lines.append(f"| {r['transport']} | {r['connections']} | {r['images_per_s']} | {_ms(r['p50_ms'])} | "
                         f"{_ms(r['p99_ms'])} | {r['shim_cpu_ms_per_image']} | {r['triton_cpu_ms_per_image']} | "
                         f"{r['errors']} | {allowed} |")
        lines.append("")
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
                  f"99.5 % and 99 %)",
                  f"- shadow tolerance for the encoded path: largest score difference {d['shadow_tolerance']}", ""]
    for name, value in data.get("partial", {}).items():
        if name not in steps:
            lines += [f"## Partial: {name} (cut short)", "", "```", json.dumps(value, indent=1), "```", ""]
    for name, error in data["errors"].items():
        lines += [f"## FAILED: {name}", "", "```", error.strip(), "```", ""]
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.device_kit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="every stage on a CPU machine (make test runs this)")
    p.add_argument("--stage", choices=("a", "b", "c", "all"), default="all")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "bench" / "out" / "device"))
    p.add_argument("--keep", type=Path, default=None,
                   help="a folder that outlives the call (the lent machine's /tmp/kit): stage c's file holds a and b")
    args = p.parse_args(argv)
    plan = DRY if args.dry_run else FULL
    results = Results(args.out, plan, args.dry_run, args.keep)
    import app

    results.data["tree"] = str(ROOT)
    if not Path(app.__file__).resolve().is_relative_to(ROOT):  # another checkout's code would be measured
        results.data["errors"]["tree"] = f"the shim's code comes from {app.__file__}, not from {ROOT}"
    stages = "abc" if args.stage == "all" else args.stage
    if "a" in stages:
        results.step("libraries", libraries)
    if "b" in stages:
        results.step("python_env", lambda: python_env(plan))
    if "c" in stages:
        measure(results, plan)
    if args.dry_run:  # last: what every stage imported, against what a lent machine has
        results.step("imports", staged_imports)
    results.write()
    print((args.out / "device_results.md").read_text())
    print(f"device kit: wrote {args.out / RESULTS} and device_results.md", flush=True)
    return 1 if results.data["errors"] else 0


def staged_imports() -> dict[str, Any]:
    """The dry run's check that a lent machine could import what this run did (bench/kit_imports.py)."""
    from bench.kit_imports import unstaged

    missing = unstaged(ROOT / "bench" / "device_check.sh")
    if missing:
        raise RuntimeError(f"imported here, but neither on a lent machine's host nor in a stage of "
                           f"bench/device_check.sh (add each to a STAGE_ array and to .kit/): {json.dumps(missing)}")
    return {"unstaged": missing}


def measure(results: Results, plan: Plan) -> None:
    work = Path(tempfile.mkdtemp(prefix="shim-device-"))
    triton = None
    try:
        repo = results.step("repository", lambda: str(build_repo(work / "repo", plan)))
        if repo is not None:
            triton = results.step("triton", lambda: start_triton(Path(repo), work / "triton", plan))
        if triton is not None:
            results.data["steps"]["triton"] = {"url": triton.http_url, "gpu": plan.gpu}
            results.step("smoke", lambda: smoke(triton, plan))
            results.step("shim", lambda: shim_rows(triton, Path(repo), work, plan, results))
            results.step("decode", lambda: decode_step(triton, plan))
            results.step("model_only", lambda: model_only(triton, plan, results))
    finally:
        if triton is not None:
            triton.stop(graceful=False)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
