"""`python -m bench --frontend`: the shim's CPU per image around a near-free model, as on a GPU host.

Rows, one after the other with the same JPEGs and clients: the decode + preprocess floor (bench/floor.py),
the legacy front, the shim per transport (each cross-checked by wrk, bench/wrk.py), and tensors straight to
Triton; docs/benchmarks.md says what each row is, bench/RESULTS.md how to read them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app.settings import Settings
from bench import floor, frontcheck, stack, wrk
from bench import profile as pyspy
from bench.loadgen import LoadGenerator
from bench.report import cpu_columns, cpu_split, front_markdown, front_ratios, summarize
from bench.run import Run, Started, Target, finish
from devstack import launch, proxy
from devstack.cpu_repo import read_config
from modelrepo.standin import write_standin_repo

ROOT = stack.ROOT
MODEL = "resnet50"
NGINX_PER_CLIENT = 32  # /predict one client address may have in progress at nginx (deploy/nginx, limit_conn)


def model_interface(repo: Path, model: str = MODEL) -> tuple[str, list[int], str, int]:
    """(input name, input dims, output name, classes) from the repository's config.pbtxt."""
    config = read_config(repo / model / "config.pbtxt")
    (inp,), (out,) = config.input, config.output
    return inp.name, [int(d) for d in inp.dims], out.name, int(out.dims[-1])


def near_free_torchscript(dest: Path, dims: Sequence[int], classes: int) -> Path:
    """modelrepo/triton_models/near_free_classifier.py's arithmetic (logit k: the sum of the k-th of `classes`
    slices of the input) as scripted torch, checked against the stand-in's reduceat and saved at dest."""
    import numpy as np
    import torch

    size = int(np.prod(dims))
    bounds = np.linspace(0, size, classes + 1)[:-1].astype(np.int64)
    segment = np.repeat(np.arange(classes), np.diff(np.append(bounds, size)))

    class NearFreeClassifier(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.classes = classes
            self.register_buffer("segment", torch.from_numpy(segment))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            flat = x.reshape(x.shape[0], -1)
            out = torch.zeros(x.shape[0], self.classes, dtype=flat.dtype)
            return out.index_add_(1, self.segment, flat)

    scripted = torch.jit.script(NearFreeClassifier().eval())
    probe = np.random.default_rng(0).standard_normal((2, *dims)).astype(np.float32)
    expected = np.add.reduceat(probe.reshape(2, -1), bounds, axis=1)
    with torch.inference_mode():
        got = scripted(torch.from_numpy(probe)).numpy()
    if got.shape != (2, classes) or not np.allclose(got, expected, rtol=1e-4, atol=1e-3):
        raise SystemExit("bench: the near-free TorchScript model does not compute what the Triton stand-in does")
    dest.parent.mkdir(parents=True, exist_ok=True)
    scripted.save(str(dest))
    return dest


def legacy_front(out: Path, model_pt: Path, labels: Path, workers: int, threads: int,
                 stopper: stack.Stopper) -> contextlib.AbstractContextManager[Any]:
    """examples/legacy_app.py under gunicorn, `workers` x `threads` (gthread), on a free port."""
    port = launch.free_port()
    env = {**os.environ, "LEGACY_MODEL_PATH": str(model_pt), "LEGACY_LABELS_PATH": str(labels)}
    cmd = [sys.executable, "-m", "gunicorn", "--bind", f"127.0.0.1:{port}", "--workers", str(workers),
           "--threads", str(threads), "--worker-class", "gthread", "--no-control-socket",
           "examples.legacy_app:app"]
    print(f"starting the legacy app ({workers} workers x {threads} threads, near-free TorchScript) ...", flush=True)
    served = launch.ServedApp("legacy app", cmd, env, port, out / "logs" / f"legacy-front-{port}.log")
    return stack.serving(served, stopper, "/", 404, 180, workers)  # no health endpoint: any contract answer will do


def flask_floor(out: Path, stopper: stack.Stopper) -> contextlib.AbstractContextManager[Any]:
    """bench/flask_floor.py under gunicorn, 2 workers x 8 threads (gthread), on a free port."""
    port = launch.free_port()
    cmd = [sys.executable, "-m", "gunicorn", "--bind", f"127.0.0.1:{port}", "--workers", "2", "--threads", "8",
           "--worker-class", "gthread", "--no-control-socket", "bench.flask_floor:app"]
    served = launch.ServedApp("Flask floor", cmd, dict(os.environ), port, out / "logs" / f"flask-floor-{port}.log")
    return stack.serving(served, stopper, "/", 404, 60, 2)


def shim_env(triton_url: str, transport: str, workers: int, threads: int) -> dict[str, str]:
    return {"SHIM_TRITON_URL": triton_url, "SHIM_MODE": "triton", "SHIM_MODEL_NAME": MODEL,
            **stack.shim_layout(workers, threads), "SHIM_TRANSPORT": transport}


def reported_transport(url: str) -> str:
    """What the shim says it uses: /readyz's "transport", "unknown" when /readyz does not answer."""
    with contextlib.suppress(OSError, ValueError):
        try:
            body = urllib.request.urlopen(url + "/readyz", timeout=10).read()
        except urllib.error.HTTPError as e:  # a 503 still carries the JSON
            body = e.read()
        transport = json.loads(body).get("transport")
        if isinstance(transport, str):
            return transport
    return "unknown"


class FrontRun(Run):
    def __init__(self, args: argparse.Namespace, out: Path, loadgen: LoadGenerator,
                 stopper: stack.Stopper | None = None) -> None:
        super().__init__(args, out, loadgen)
        if stopper is not None:  # servers of an earlier part still stopping: the first window waits for them
            self.stopper = stopper
        self.wrk: str | None = None  # the binary, when the shim rows are cross-checked
        self.wrk_script: Path | None = None

    def shim(self, triton_url: str, transport: str) -> contextlib.AbstractContextManager[Any]:
        env = shim_env(triton_url, transport, self.args.shim_workers, self.args.shim_threads)
        return stack.serve_shim(self.logs, env, self.stopper, self.args.shim_workers)

    def measure_row(self, config: str, kind: str, label: str, description: str, url: str, requests: tuple[bytes, ...],
                expect: bytes, watch: dict[str, tuple[int, ...]], transport: str | None = None,
                shim_metrics: str | None = None, triton_metrics: str | None = None,
                extra: dict[str, Any] | None = None, levels: Sequence[int] | None = None) -> dict[str, Any]:
        self.configurations.append({"config": config, "label": label, "description": description})
        target = Target(config, label, description, url, requests, expect, shim_metrics=shim_metrics,
                        triton_metrics=triton_metrics, watch={**watch, "loadgen": self.loadgen.pids},
                        extra={"kind": kind, "transport": transport, **(extra or {})})
        row: dict[str, Any] = {}
        for concurrency in levels or self.args.levels:
            row = self.measure_one(target, concurrency)
            machine = row.get("machine") or {}
            print("    CPU ms per image: " + ", ".join(f"{g} {v:.2f}" for g, v in row["cpu_ms_per_image"].items()
                                                        if v is not None)
                  + f"; rest of the machine {machine.get('other_cpu_ms_per_image') or 0:.2f}, "
                    f"idle {machine.get('idle_pct') or 0:.0f} %", flush=True)
            if kind == "shim" and self.wrk and self.wrk_script:
                checked = wrk.measure(self.wrk, self.wrk_script, url, concurrency, self.args.duration,
                                      {k: v for k, v in watch.items() if k in ("shim", "triton")})
                row["wrk"] = checked
                print(f"    wrk, the same shim: {checked['qps']:.1f} images/s, shim CPU "
                      f"{checked['cpu_ms_per_image'].get('shim') or 0:.2f} ms per image, Triton "
                      f"{checked['cpu_ms_per_image'].get('triton') or 0:.2f}; {checked['non_2xx']} non-2xx, "
                      f"{checked['socket_errors']} socket errors", flush=True)
            split = cpu_split(row) if kind == "shim" else None
            if split:
                print("    the shim's CPU ms per image: " + ", ".join(f"{k} {v:.2f}" for k, v in split.items()),
                      flush=True)
        return row

    def measure_floor(self, processes: int) -> None:
        label = f"floor: decode + preprocess, {processes} processes"
        description = (f"`app.preprocess.decode` + `to_tensor` (FP32) in {processes} spawned processes on the same "
                       f"{len(self.jpegs)} JPEGs, no HTTP, {self.args.warmup:g} s + {self.args.duration:g} s")
        self.configurations.append({"config": "floor", "label": label, "description": description})
        print(f"{label} ...", flush=True)
        self.stopper.settle()
        load_before = os.getloadavg()[0]
        outcome, window = floor.run_floor(self.jpegs, processes, self.args.warmup, self.args.duration,
                                          {"loadgen": self.loadgen.pids})
        row = {"config": "floor", "kind": "floor", "transport": None, "label": label, "number": None,
               "concurrency": min(self.args.levels), "processes": processes, **summarize(outcome), "breakdown": {},
               "load_average_before": round(load_before, 2),
               "load_average_after": round(os.getloadavg()[0], 2)}
        row.update(cpu_columns(window, row["answers"]))
        row["loadgen_cpu_pct"] = row["loadgen_cpu_ms_per_request"] = None
        self.rows.append(row)
        self.record("floor", processes, outcome)
        print(f"  {label}: {row['qps']:.1f} images/s, CPU {row['cpu_ms_per_image']['floor']:.2f} ms per image "
              f"({window['floor']['processes']} processes); rest of the machine "
              f"{(row.get('machine') or {}).get('other_cpu_ms_per_image') or 0:.2f}, idle "
              f"{(row.get('machine') or {}).get('idle_pct') or 0:.0f} %", flush=True)


def proxied_row(front: FrontRun, triton: Any, tpid: int, transport: str) -> None:
    """One more row: a fresh shim with `transport` behind nginx as deployed (deploy/nginx: its edge and admission
    servers, the access log sent to the shim), nginx's CPU per image beside the shim's: the proxy's share of a
    host. At the lowest client count only, and at most NGINX_PER_CLIENT: every client here is 127.0.0.1."""
    if proxy.nginx_binary() is None:
        print(f"note: no nginx row ({proxy.MISSING})", flush=True)
        return
    address = f"127.0.0.1:{proxy.free_udp_port()}"
    env = {**shim_env(triton.http_url, transport, front.args.shim_workers, front.args.shim_threads),
           "SHIM_PROXY_HOPS": "1", "SHIM_PROXY_LOG_ADDRESS": address}
    settings = Settings(max_pending=int(env["SHIM_MAX_PENDING"]), proxy_log_address=address)
    with stack.serve_shim(front.logs, env, front.stopper, front.args.shim_workers) as served:
        nginx = proxy.Proxy(front.out / "nginx", f"127.0.0.1:{served.port}", settings=settings)
        try:
            nginx.wait()
            front.measure_row(f"shim-{transport}-nginx", "proxied", f"shim [{transport}] behind nginx",
                              f"the shim as the {transport} row, SHIM_PROXY_HOPS=1, behind deploy/nginx's "
                              "configuration (edge and admission servers, access log to the shim)",
                              nginx.url, front.predict_requests(nginx.url), b'"predictions"',
                              {"shim": (served.process.pid,), "nginx": (nginx.process.pid,), "triton": (tpid,)},
                              transport=transport, shim_metrics=served.url + "/metrics",
                              triton_metrics=triton.metrics_url, levels=[min(*front.args.levels, NGINX_PER_CLIENT)])
        finally:
            front.stopper.later(nginx.stop)


def profile_row(front: FrontRun, served: Any, tpid: int, transport: str) -> dict[str, Any]:
    """One more window on a fresh shim with `transport`, py-spy recording its first worker while it is measured."""
    pid = stack.wait_for_children(served.process.pid, front.args.shim_workers)[0]
    raws = {"working": front.out / f"profile-{transport}-{pid}.raw",
            "gil": front.out / f"profile-{transport}-{pid}-gil.raw"}
    state: dict[str, Any] = {}

    def attach() -> None:  # the window opens: both recorders for its length
        state.update({kind: pyspy.start(pid, front.args.duration, raw, gil=kind == "gil")
                      for kind, raw in raws.items()})

    label = f"shim [{transport}] under py-spy"
    target = Target(f"shim-{transport}-profiled", label, f"the shim with SHIM_TRANSPORT={transport} again, "
                    f"py-spy recording worker {pid}", served.url, front.predict_requests(served.url),
                    b'"predictions"', watch={"shim": (served.process.pid,), "triton": (tpid,),
                                             "loadgen": front.loadgen.pids},
                    extra={"kind": "profiled", "transport": transport})
    front.configurations.append({"config": target.config, "label": label, "description": target.description})
    concurrency = max(front.args.levels)
    row = front.measure_one(target, concurrency, attach)
    if not state:
        return {"pid": pid, "error": "the measured window never opened"}
    result = {kind: pyspy.finish(state[kind], raw, front.args.duration, gil=kind == "gil")
              for kind, raw in raws.items()}
    errors = [r["error"] for r in result.values() if "error" in r]
    print(f"  {label}: {row['qps']:.1f} images/s while profiled", flush=True)
    return {"pid": pid, "seconds": front.args.duration, "rate": pyspy.RATE, **result,
            **({"error": "; ".join(errors)} if errors else {}), "transport": transport, "qps": row["qps"],
            "concurrency": concurrency, "shim_workers": front.args.shim_workers,
            "shim_threads": front.args.shim_threads}


def main(args: argparse.Namespace, argv: Sequence[str] | None, out: Path | None = None,
         stopper: stack.Stopper | None = None) -> int:
    started = Started.now(argv)
    out = (out or args.out or ROOT / "bench" / "out" / f"{started.stamp:%Y%m%d-%H%M%S}-frontend").resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    usable = len(os.sched_getaffinity(0))
    processes = args.floor_processes or usable
    # floors, legacy, shims (+ wrk), encoded behind nginx, direct, profile
    rows_planned = 3 + 2 * len(args.transports) + ("encoded" in args.transports) + 1 + bool(args.profile)
    print(f"front-end benchmark: floor ({processes} processes), Flask floor, legacy front, shim x "
          f"{', '.join(args.transports)}, direct{', profile' if args.profile else ''}; clients {args.levels}, "
          f"{args.warmup:g} s + {args.duration:g} s per row: {rows_planned} rows, about "
          f"{(rows_planned * (args.warmup + args.duration) + 15 + 8 * rows_planned) / 60:.0f} min; output in {out}",
          flush=True)

    repo = write_standin_repo(out / "standin_repo", near_free_decode="encoded" in args.transports)
    input_name, dims, output_name, classes = model_interface(repo)
    labels = repo / MODEL / "labels.txt"
    model_pt = near_free_torchscript(out / "models" / "near_free_classifier.pt", dims, classes)
    notes = [f"The model: {repo / MODEL} (modelrepo/standin.py: a numpy python-backend stand-in with resnet50's "
             f"interface, {input_name} FP32 {dims} -> {output_name} FP32 [{classes}]) for the shim and direct rows; "
             f"{model_pt} (the same sums, as scripted torch) for the legacy front."]
    if "encoded" in args.transports:
        notes.append(f"The encoded rows' decode step: {repo / (MODEL + '_decode')} (modelrepo/triton_models/"
                     "near_free_decode.py: its interface, zeros for every JPEG, nothing decoded), so that the shim "
                     "runs at the rate a GPU host would drive it.")
    work = Path(tempfile.mkdtemp(prefix="shim-bench-front-"))
    machine = stack.machine_info()
    profile: dict[str, Any] | None = None
    wrk_note = None
    with LoadGenerator(args.loadgen_processes) as loadgen:
        front = FrontRun(args, out, loadgen, stopper)
        if not args.no_wrk:
            front.wrk = wrk.find_or_install()
            if front.wrk:
                front.wrk_script = wrk.lua_script(out / "wrk", front.jpegs)
            else:
                wrk_note = "wrk is not installed (and could not be: needs apt-get as root): no cross-check."
                print(f"note: {wrk_note}", flush=True)
        else:
            wrk_note = "--no-wrk: no cross-check."
        try:
            front.measure_floor(processes)
            with legacy_front(out, model_pt, labels, args.legacy_workers, args.legacy_threads,
                              front.stopper) as served:
                front.measure_row("legacy-front", "legacy", f"legacy front, gunicorn {args.legacy_workers}x"
                              f"{args.legacy_threads}",
                              f"examples/legacy_app.py under gunicorn, {args.legacy_workers} workers x "
                              f"{args.legacy_threads} threads, the near-free TorchScript model in-process "
                              "(torchvision transforms, softmax, top 5)",
                              served.url, front.predict_requests(served.url), b'"predictions"',
                              {"legacy": (served.process.pid,)})
            with flask_floor(out, front.stopper) as served:
                front.measure_row("flask-floor", "flask", "Flask floor, gunicorn 2x8",
                                  "bench/flask_floor.py under gunicorn, 2 workers x 8 threads: reads the multipart "
                                  "upload, answers a fixed JSON of the contract's shape",
                                  served.url, front.predict_requests(served.url), b'"predictions"',
                                  {"flask": (served.process.pid,)})
            print("starting Triton (the near-free stand-in repository) ...", flush=True)
            triton = stack.start_triton(repo, work / "triton")
            try:
                tpid = stack.triton_pid(triton)
                served_config = front.served_config("front", triton.http_url)
                for transport in args.transports:
                    with front.shim(triton.http_url, transport) as served:
                        reported = reported_transport(served.url)
                        print(f"  the shim reports transport: {reported}", flush=True)
                        front.measure_row(f"shim-{transport}", "shim", f"shim [{transport}]",
                                      f"the shim ({args.shim_workers} workers x {args.shim_threads} threads, "
                                      f"SHIM_TRANSPORT={transport}, reports {reported}) -> Triton: {served_config}",
                                      served.url, front.predict_requests(served.url), b'"predictions"',
                                      {"shim": (served.process.pid,), "triton": (tpid,)}, transport=transport,
                                      shim_metrics=served.url + "/metrics", triton_metrics=triton.metrics_url,
                                      extra={"transport_reported": reported})
                if "encoded" in args.transports:
                    proxied_row(front, triton, tpid, "encoded")
                front.measure_row("direct-front", "direct", "direct tritonclient -> Triton",
                              f"ready-made FP32 [1,{','.join(map(str, dims))}] binary-tensor requests straight to "
                              f"Triton: {served_config}", f"http://{triton.http_url}",
                              front.infer_requests(triton.http_url), b'"outputs"', {"triton": (tpid,)},
                              triton_metrics=triton.metrics_url)
                if args.profile:
                    level = max(args.levels)
                    shims = [r for r in front.rows if r["kind"] == "shim" and r["concurrency"] == level]
                    best = max(shims, key=lambda r: r["qps"])["transport"] if shims else args.transports[0]
                    print(f"profiling one shim worker, transport {best} (the best by throughput) ...", flush=True)
                    with front.shim(triton.http_url, best) as served:
                        profile = profile_row(front, served, tpid, best)
            finally:
                front.stopper.later(lambda: stack.stop_keeping_log(triton, out / "logs" / "tritonserver-front.log"))
        finally:
            front.stopper.later(lambda: shutil.rmtree(work, ignore_errors=True))  # after Triton, which uses it
            front.close()

    if usable <= 4:
        notes.append(f"Only {usable} CPU cores: the load generator, the server under test and Triton share them; "
                     "read ratios measured in one run, not absolutes.")
    settings = {"floor_processes": processes, "transports": list(args.transports), "shim_workers": args.shim_workers,
                "shim_threads": args.shim_threads, "legacy_workers": args.legacy_workers,
                "legacy_threads": args.legacy_threads}
    report = front.report(started, machine, notes, settings, mode="frontend",
                          model={"name": MODEL, "repository": str(repo), "legacy_model": str(model_pt),
                                 "description": f"near-free (a stand-in with resnet50's interface: {input_name} FP32 "
                                                f"{dims} -> {output_name} FP32 [{classes}], one pass over the input)"},
                          ratios=front_ratios(front.rows), encoded_checks=frontcheck.encoded_checks(front.rows),
                          crosscheck_lines=frontcheck.lines(front.rows, usable, wrk_note), profile=profile)
    return finish(front, report, front_markdown, started)
