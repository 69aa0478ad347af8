"""`python -m bench` (make bench): the seed's Flask-vs-Triton table, reproduced on this machine in one run.

Configurations (--configs), started on loopback in turn: (1) legacy, the old app in one process; (2) triton-instances,
no batching anywhere; (3) triton-batching, the shim's defaults; (0) direct, ready tensors to (3)'s Triton; (4)
litserve, a peer. Output in bench/out/<time>-<arch>/: results.json, .md, .png, requests.csv (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app import settings as shim_settings
from bench import perf_analyzer, stack
from bench.loadgen import Job, LoadGenerator, Outcome, StubServer, multipart_request, post_request
from bench.report import NUMBER, ORDER, SEED_ROWS, cpu_columns, markdown, plot, ratios, short_warmup_notes, summarize
from devstack import launch
from modelrepo.export import write_labels

ROOT = stack.ROOT
CONFIGS = ORDER


TRANSPORTS = tuple(shim_settings.TRANSPORTS)  # the shim's SHIM_TRANSPORT values: one front-end row each
DEFAULTS = {"arch": "resnet50", "duration": 20.0, "warmup": 5.0, "concurrency": "1,4,16,32"}
QUICK = {"arch": "resnet18", "duration": 3.0, "warmup": 1.0, "concurrency": "1,8"}
FRONT_DEFAULTS = {"duration": 20.0, "warmup": 5.0, "concurrency": "16"}  # --frontend
FRONT_QUICK = {"duration": 1.5, "warmup": 0.5, "concurrency": "16"}  # --frontend --quick
IMAGES = 16
IMAGE_SIZE = (640, 480)
CEILING_S = 2.0
QUICK_CEILING_S = 1.0  # --quick: the ceiling only has to show that the load generator is not the bottleneck
STARTUP_ALLOWANCE_S = 60  # exports, Triton and gunicorn starts and stops, on this kind of machine


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"smoke-sized run: {', '.join(f'{k} {v}' for k, v in QUICK.items())} (each still overridable)")
    p.add_argument("--arch", choices=("resnet18", "resnet50"), help=f"model to export (default {DEFAULTS['arch']})")
    p.add_argument("--model-pt", type=Path, help="benchmark this TorchScript file instead of exporting --arch")
    p.add_argument("--duration", type=float, help=f"measured seconds per row (default {DEFAULTS['duration']:g})")
    p.add_argument("--warmup", type=float, help=f"discarded seconds before each row (default {DEFAULTS['warmup']:g})")
    p.add_argument("--concurrency", help=f"closed-loop clients, comma-separated (default {DEFAULTS['concurrency']})")
    p.add_argument("--configs", help=f"which configurations, comma-separated (default all: {','.join(CONFIGS)}; "
                                     "--quick, make test's: all but litserve)")
    p.add_argument("--triton-url", help="a running Triton (host:port) instead of a local one; skips (2)")
    p.add_argument("--triton-metrics-url", help="its metrics (default: http://<triton host>:8002/metrics)")
    p.add_argument("--shim-url", help="a running shim to measure as (3); needs --triton-url, its Triton")
    p.add_argument("--legacy-url", help="an already-running legacy app to measure as (1) instead of starting one")
    p.add_argument("--model-name", default="resnet50", help="the Triton model (default resnet50)")
    p.add_argument("--model-repository", type=Path, help="the model <repository>/<model-name>/model.toml describes")
    p.add_argument("--legacy-transform", help="with --model-repository: the legacy app's transform, module:attribute "
                                              "(default examples.transforms:<model-name>)")
    p.add_argument("--legacy-threads", type=int, help="the legacy app's threads (default 4; --frontend: 8 per worker)")
    p.add_argument("--shim-workers", type=int,
                   help=f"the shim's gunicorn workers (default: the shim's own, {stack.shim_default('workers')})")
    p.add_argument("--shim-threads", type=int,
                   help=f"threads per shim worker (default: the shim's own, {stack.shim_default('threads')}); "
                        "SHIM_MAX_PENDING becomes threads - 8: clients beyond it get 503s, counted as errors")
    p.add_argument("--loadgen-processes", type=int, default=max(1, min(4, (os.cpu_count() or 1) // 4)),
                   help="load generator processes sharing the clients (default: cores / 4, from 1 to 4)")
    p.add_argument("--timeout", type=float, default=60.0, help="per-request timeout in seconds (default 60)")
    p.add_argument("--out", type=Path, help="output folder (default bench/out/<time>-<arch> or -frontend)")
    front = p.add_argument_group("front-end mode (bench/frontend.py)")
    front.add_argument("--both", action="store_true",
                       help="the Flask-vs-Triton rows, then the front-end rows (into <out>/frontend/); --warmup, "
                            "--duration and --concurrency, when given, apply to both")
    front.add_argument("--frontend", action="store_true",
                       help="the shim's CPU per image around a near-free model: floor, legacy front, the shim per "
                            "transport, direct; clients 16, 5 s + 20 s per row (--quick: 0.5 s + 1.5 s)")
    front.add_argument("--transports", default=",".join(TRANSPORTS),
                       help=f"the shim's SHIM_TRANSPORT values, one row each (default {','.join(TRANSPORTS)})")
    front.add_argument("--profile", action="store_true",
                       help="then py-spy on one shim worker of the best transport over one more window (needs py-spy)")
    front.add_argument("--floor-processes", type=int, help="processes of the floor row (default: usable cores)")
    front.add_argument("--legacy-workers", type=int, default=2, help="the legacy front's gunicorn workers (default 2)")
    front.add_argument("--no-wrk", action="store_true",
                       help="skip the cross-check of each shim row with wrk (installed by apt-get as root)")
    args = p.parse_args(argv)
    args.shim_workers = args.shim_workers or stack.shim_default("workers")
    args.shim_threads = args.shim_threads or stack.shim_default("threads")
    if args.frontend and args.both:
        p.error("--both already runs the front-end rows: drop --frontend")
    args.transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if args.frontend:
        for flag in ("configs", "triton_url", "shim_url", "legacy_url", "model_pt", "triton_metrics_url"):
            if getattr(args, flag) not in (None, p.get_default(flag)):
                p.error(f"--{flag.replace('_', '-')} belongs to the Flask-vs-Triton benchmark, not --frontend "
                        "(which starts its own near-free Triton, shim and legacy front)")
        if not args.transports or len(set(args.transports)) < len(args.transports):
            p.error(f"--transports {','.join(args.transports)!r}: expected distinct names, e.g. {','.join(TRANSPORTS)}")
        for name in ("floor_processes", "shim_workers", "shim_threads", "legacy_workers"):
            if getattr(args, name) is not None and not 1 <= getattr(args, name) <= 256:
                p.error(f"--{name.replace('_', '-')} must be from 1 to 256")
    elif not args.both and (args.profile or args.transports != list(TRANSPORTS)):
        p.error("--profile and --transports need --frontend or --both")
    args.explicit = {k for k in ("duration", "warmup", "concurrency", "legacy_threads") if getattr(args, k) is not None}
    if args.legacy_threads is None:
        args.legacy_threads = 8 if args.frontend else 4
    preset = (FRONT_QUICK if args.quick else FRONT_DEFAULTS) if args.frontend else QUICK if args.quick else DEFAULTS
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.levels = levels(args.concurrency)
    except ValueError as e:
        p.error(str(e))
    if args.configs is None:  # the peer's start-up and warm-up would double --quick's time
        args.configs = ",".join(c for c in CONFIGS if not (args.quick and c == "litserve"))
    args.selected = [c.strip() for c in args.configs.split(",") if c.strip()]
    if unknown := set(args.selected) - set(CONFIGS):
        p.error(f"--configs: unknown {', '.join(sorted(unknown))}; choose from {', '.join(CONFIGS)}")
    if not 1 <= args.loadgen_processes <= 64:
        p.error("--loadgen-processes must be from 1 to 64")
    if args.duration <= 0 or args.warmup < 0:
        p.error("--duration must be positive and --warmup not negative")
    if args.shim_url and not args.triton_url:
        p.error("--shim-url needs --triton-url: the Triton that shim forwards to (for the direct ceiling and "
                "Triton's metrics)")
    args.description = None
    if args.model_repository is not None:
        from app.description import DescriptionError, description_path, load

        try:
            args.description = load(description_path(args.model_repository, args.model_name))
        except DescriptionError as e:
            p.error(str(e))
        args.model_pt = args.model_pt or args.description.model_file()
    if args.model_pt is not None and not args.model_pt.is_file():
        p.error(f"--model-pt {args.model_pt} does not exist")
    return args


def levels(concurrency: str) -> list[int]:
    try:
        out = sorted({int(c) for c in str(concurrency).split(",") if c.strip()})
    except ValueError:
        raise ValueError(f"--concurrency {concurrency!r}: expected whole numbers separated by commas") from None
    if not out or min(out) < 1 or max(out) > 1024:
        raise ValueError(f"--concurrency {concurrency!r}: expected numbers from 1 to 1024")
    return out


def ceiling_s(args: argparse.Namespace) -> float:
    return QUICK_CEILING_S if args.quick else CEILING_S


def fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


@dataclass(frozen=True)
class Started:
    """A run's command line and start: the first fields of its report."""

    command: str
    stamp: datetime.datetime
    at: float  # time.monotonic()

    @staticmethod
    def now(argv: Sequence[str] | None) -> Started:
        command = shlex.join(["python", "-m", "bench", *(sys.argv[1:] if argv is None else argv)])
        return Started(command, datetime.datetime.now().astimezone(), time.monotonic())


@dataclass
class Target:
    """Where one configuration answers, how to ask it, and where its metrics are."""

    config: str
    label: str
    description: str
    url: str
    requests: tuple[bytes, ...]
    expect: bytes
    shim_metrics: str | None = None
    triton_metrics: str | None = None
    # Process trees whose CPU time over the measured window goes into the row (bench/cpu.py): group -> root PIDs
    watch: dict[str, tuple[int, ...]] | None = None
    extra: dict[str, Any] | None = None  # more fields for the row (the front-end rows' transport)


def describe_triton_config(config: dict[str, Any]) -> str:
    """'2 instances (KIND_CPU), dynamic batching (preferred [8, 16, 32], max delay 500 us)', from Triton itself."""
    groups = config.get("instance_group") or []
    count = sum(int(g.get("count", 1)) * max(1, len(g.get("gpus") or [])) for g in groups) or 1
    kinds = "/".join(sorted({str(g.get("kind", "KIND_AUTO")) for g in groups})) or "KIND_AUTO"
    text = f"{count} instance{'s' if count != 1 else ''} ({kinds}), max batch {config.get('max_batch_size')}"
    batching = config.get("dynamic_batching")
    if batching is None:
        return text + ", no dynamic batching"
    preferred = [int(x) for x in batching.get("preferred_batch_size", [])]
    delay = batching.get("max_queue_delay_microseconds", 0)
    return text + f", dynamic batching (preferred {preferred}, max delay {delay} us)"


class Run:
    """One benchmark run: its output folder, load generator, progress, and what it measured."""

    def __init__(self, args: argparse.Namespace, out: Path, loadgen: LoadGenerator) -> None:
        self.args, self.out, self.loadgen = args, out, loadgen
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = []
        self.configurations: list[dict[str, str]] = []
        self.triton_configs: dict[str, Any] = {}
        self.triton_server: dict[str, Any] | None = None  # Triton's own /v2 metadata: name, version
        self._csv_file = (out / "requests.csv").open("w", newline="")
        self._csv = csv.writer(self._csv_file)
        self._csv.writerow(["config", "clients", "phase", "start_s", "latency_ms", "error", "client"])
        self.jpegs = stack.sample_jpegs(IMAGES, *IMAGE_SIZE)
        description = getattr(args, "description", None)
        from app.preprocess import ImageSpec

        self.ready_tensors = stack.ready_tensors(self.jpegs, ImageSpec.of(description) if description else None)
        self.stopper = stack.Stopper()  # servers stop in the background; every window waits for them first
        self.perf_analyzer: dict[str, Any] = {"rows": [], "skipped": None}  # bench/perf_analyzer.py's rows

    def close(self, settle: bool = True) -> None:
        """settle=False: servers still stopping go on in the background (the next part of --both waits)."""
        try:
            if settle:
                self.stopper.settle()
        except Exception as e:  # the run's own error, if any, is the one to see
            print(f"bench: stopping a server failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            self._csv_file.close()

    def report(self, started: Started, machine: dict[str, Any], notes: list[str], settings: dict[str, Any],
               **fields: Any) -> dict[str, Any]:
        """results.json: what every run reports, then `fields`."""
        a = self.args
        return {"command": started.command, "started": started.stamp.isoformat(timespec="seconds"),
                "elapsed_s": time.monotonic() - started.at, "machine": machine,
                "settings": {"warmup_s": a.warmup, "duration_s": a.duration, "concurrency": a.levels, "images": IMAGES,
                             "image_size": f"{IMAGE_SIZE[0]}x{IMAGE_SIZE[1]}", "timeout_s": a.timeout,
                             "quick": a.quick, "loadgen_processes": a.loadgen_processes, **settings},
                "configurations": self.configurations, "triton_configs": self.triton_configs, "results": self.rows,
                "notes": notes, **fields}

    def measure_perf_analyzer(self, triton_url: str) -> None:
        """Triton's own perf_analyzer at each level, after the direct row on the same Triton (not in --quick:
        make test checks the tool itself, tests/integration/test_perf_analyzer.py)."""
        if self.args.quick:
            self.perf_analyzer["skipped"] = "--quick"
            return
        tool, why = perf_analyzer.find_or_install()
        if tool is None:
            self.perf_analyzer["skipped"] = why
            print(f"note: {why}; the perf_analyzer rows are skipped", flush=True)
            return
        self.perf_analyzer["tool"] = why
        for concurrency in self.args.levels:
            print(f"  perf_analyzer -> Triton c={concurrency} ...", flush=True)
            self.stopper.settle()
            try:
                row = perf_analyzer.measure(tool, triton_url, self.args.model_name, concurrency,
                                            self.args.warmup + self.args.duration, self.logs)
            except RuntimeError as e:
                self.perf_analyzer["skipped"] = str(e)
                print(f"note: {e}", flush=True)
                return
            self.perf_analyzer["rows"].append(row)
            print(f"  perf_analyzer -> Triton c={concurrency}: {row['qps']:.1f} infer/s, p50 {row['p50_ms']:.1f} ms, "
                  f"p99 {row['p99_ms']:.1f} ms", flush=True)

    def predict_requests(self, url: str) -> tuple[bytes, ...]:
        host, port = stack.split_url(url)
        return tuple(multipart_request(host, port, "/predict", "image", f"photo-{i}.jpg", "image/jpeg", jpeg)
                     for i, jpeg in enumerate(self.jpegs))

    def infer_requests(self, triton_url: str) -> tuple[bytes, ...]:
        """Binary-tensor infer requests with the images ready-made, names and dtype from the model's metadata."""
        host, port = stack.split_url(triton_url)
        meta = stack.http_json(f"http://{host}:{port}/v2/models/{self.args.model_name}")
        (inp,), (output,) = meta["inputs"], meta["outputs"]
        return self.infer_requests_for(triton_url, self.ready_tensors, inp["name"], inp["datatype"], output["name"])

    def infer_requests_for(self, url: str, tensors: Sequence[Any], input_name: str = "input__0",
                           datatype: str = "FP32", output_name: str = "output__0") -> tuple[bytes, ...]:
        import tritonclient.http as httpclient

        host, port = stack.split_url(url)
        path = f"/v2/models/{self.args.model_name}/infer"
        out = []
        for tensor in tensors:
            infer_input = httpclient.InferInput(input_name, list(tensor.shape), datatype)
            infer_input.set_data_from_numpy(tensor, binary_data=True)
            wanted = [httpclient.InferRequestedOutput(output_name, binary_data=True)]
            body, json_size = httpclient.InferenceServerClient.generate_request_body([infer_input], outputs=wanted)
            extra = [("Inference-Header-Content-Length", str(json_size))] if json_size is not None else []
            out.append(post_request(host, port, path, body, "application/octet-stream", extra))
        return tuple(out)

    def served_config(self, config: str, triton_url: str) -> str:
        """What the Triton at triton_url really serves, described from its own /config; kept in the results."""
        host, port = stack.split_url(triton_url)
        served = stack.http_json(f"http://{host}:{port}/v2/models/{self.args.model_name}/config")
        if self.triton_server is None:
            self.triton_server = stack.http_json(f"http://{host}:{port}/v2")
        self.triton_configs[config] = served
        return describe_triton_config(served)

    def job(self, url: str, requests: tuple[bytes, ...], expect: bytes, concurrency: int, warmup_s: float,
            duration_s: float, watch: tuple[tuple[str, tuple[int, ...]], ...] = ()) -> Job:
        host, port = stack.split_url(url)
        return Job(host=host, port=port, requests=requests, expect=expect, concurrency=concurrency,
                   warmup_s=warmup_s, duration_s=duration_s, timeout_s=self.args.timeout, watch=watch)

    def drive(self, name: str, job: Job, on_measure: Callable[[], None] | None = None) -> Outcome:
        """Run `job` with a progress bar (on a terminal); on_measure() is called when the window opens."""
        from tqdm import tqdm  # type: ignore[import-untyped]

        total = job.warmup_s + job.duration_s
        bar = tqdm(total=round(total, 1), desc=f"{name:<36.36} c={job.concurrency:<3}", unit="s", leave=True,
                   mininterval=0.5, bar_format="{desc} {bar:20} {n:.0f}/{total:.0f} s{postfix}", file=sys.stderr,
                   disable=not sys.stderr.isatty())
        state = {"measuring": False}

        def tick(elapsed: float, done: int, errors: int) -> None:
            phase = self.loadgen.phase
            if phase == "measure" and not state["measuring"]:
                state["measuring"] = True
                if on_measure is not None:
                    on_measure()
            bar.n = round(min(elapsed, total), 1)
            bar.set_postfix_str(f"{phase:<8} {done} answers, {errors} errors", refresh=False)
            bar.refresh()

        try:
            return self.loadgen.run(job, tick)
        finally:
            bar.close()

    def measure(self, target: Target) -> None:
        self.configurations.append({"config": target.config, "label": target.label,
                                    "description": target.description})
        for concurrency in self.args.levels:
            self.measure_one(target, concurrency)

    def measure_one(self, target: Target, concurrency: int,
                    on_measure: Callable[[], None] | None = None) -> dict[str, Any]:
        """One row: warm-up, window and the metrics' deltas over it; on_measure() when the window opens."""
        before: dict[str, stack.Samples | None] = {}

        def scrape_before() -> None:  # called by drive() when the window opens
            before["shim"] = stack.scrape(target.shim_metrics) if target.shim_metrics else None
            before["triton"] = stack.scrape(target.triton_metrics) if target.triton_metrics else None
            if on_measure is not None:
                on_measure()

        self.stopper.settle()
        load_before = os.getloadavg()[0]
        job = self.job(target.url, target.requests, target.expect, concurrency, self.args.warmup, self.args.duration,
                       tuple((target.watch or {}).items()))
        outcome = self.drive(target.label, job, scrape_before)
        breakdown: dict[str, Any] = {}
        shim_before, triton_before = before.get("shim"), before.get("triton")
        if target.shim_metrics and shim_before is not None:
            after = stack.scrape(target.shim_metrics)
            breakdown["shim"] = stack.shim_breakdown(shim_before, after) if after else None
        if target.triton_metrics and triton_before is not None:
            after = stack.scrape(target.triton_metrics)
            breakdown["triton"] = stack.triton_breakdown(triton_before, after, self.args.model_name) if after else None
        row = {"config": target.config, "number": NUMBER.get(target.config), "label": target.label,
               "concurrency": concurrency, **(target.extra or {}), **summarize(outcome), "breakdown": breakdown,
               "load_average_before": round(load_before, 2), "load_average_after": round(os.getloadavg()[0], 2)}
        if target.watch:
            row.update(cpu_columns(outcome.cpu_window or {}, row["answers"]))
        self.rows.append(row)
        self.record(target.config, concurrency, outcome)
        print(f"  {target.label} c={concurrency}: {row['qps']:.1f} QPS, p50 {fmt_ms(row['p50_ms'])}, "
              f"p99 {fmt_ms(row['p99_ms'])}, {row['errors']} errors", flush=True)
        if row["errors"] or row["warmup_errors"]:
            print(f"  !! {target.label} c={concurrency}: {row['errors']} errors in the window "
                  f"({row['error_kinds']}), {row['warmup_errors']} in warm-up; see {self.logs}", flush=True)
        return row

    def record(self, config: str, concurrency: int, outcome: Outcome) -> None:
        for start, end, latency, error, client in zip(outcome.starts, outcome.ends, outcome.latencies,
                                                      outcome.errors, outcome.clients, strict=True):
            phase = "warmup" if end < 0 else "measure" if end < outcome.window_s else "after"
            self._csv.writerow([config, concurrency, phase, f"{start:.6f}", f"{latency * 1000:.3f}", error, client])

    def ceiling(self, stub_port: int, tensors: bool) -> list[dict[str, Any]]:
        """The load generator against a stub that answers at once: uploads, and (at the top level) tensor bodies."""
        url = f"http://127.0.0.1:{stub_port}"
        kinds = [("multipart JPEG", self.predict_requests(url), self.args.levels)]
        if tensors:
            kinds.append(("FP32 tensor", self.infer_requests_for(url, self.ready_tensors), self.args.levels[-1:]))
        rows = []
        self.stopper.settle()
        for kind, requests, levels in kinds:
            size = sum(len(r) for r in requests) / len(requests) / 1000
            for concurrency in levels:
                outcome = self.drive(f"load generator -> stub ({kind})",
                                     self.job(url, requests, b"ok", concurrency, 0.5, ceiling_s(self.args)))
                rows.append({"request": f"{kind}, {size:.0f} kB", "concurrency": concurrency, **summarize(outcome)})
                print(f"  load generator -> stub, {kind} c={concurrency}: {rows[-1]['qps']:.0f} req/s, "
                      f"{rows[-1]['errors']} errors", flush=True)
        return rows


@contextlib.contextmanager
def triton_variant(run: Run, work: Path, variant: stack.Variant, model_pt: Path) -> Iterator[Any]:
    description = run.args.description
    repo = stack.variant_repo(work / "repos", variant, model_pt, model=run.args.model_name,
                              source=description.folder.parent if description else stack.TRITON_REPO)
    shutil.copy(repo / run.args.model_name / "config.pbtxt", run.logs / f"config-{variant.name}.pbtxt")
    print(f"starting Triton ({variant.name}: {variant.instances} instances, dynamic batching "
          f"{'on' if variant.dynamic_batching else 'off'}) ...", flush=True)
    triton = stack.start_triton(repo, work / f"triton-{variant.name}")
    try:
        yield triton
    finally:
        run.stopper.later(lambda: stack.stop_keeping_log(triton, run.logs / f"tritonserver-{variant.name}.log"))


@contextlib.contextmanager
def shim(run: Run, triton_url: str, **settings: str) -> Iterator[str]:
    repository = {"SHIM_MODEL_REPOSITORY": str(run.args.model_repository)} if run.args.model_repository else {}
    env = {"SHIM_TRITON_URL": triton_url, "SHIM_MODE": "triton", "SHIM_MODEL_NAME": run.args.model_name,
           **repository,  # the model.toml there names the labels and the legacy model
           **stack.shim_layout(run.args.shim_workers, run.args.shim_threads), **settings}
    with stack.serve_shim(run.logs, env, run.stopper) as served:
        yield served.url


def gunicorn(run: Run) -> str:
    return f"{run.args.shim_workers} workers x {run.args.shim_threads} threads"


def run_legacy(run: Run, model_pt: Path, labels: Path) -> None:
    label = "(1) legacy Flask app, 1 process"
    if run.args.legacy_url:
        url = run.args.legacy_url.rstrip("/")
        description = f"the legacy app already running at {url}"
        served = None
    else:
        print("starting the legacy app ...", flush=True)
        description = run.args.description
        legacy_env = {} if description is None else {
            "LEGACY_TRANSFORM": run.args.legacy_transform or f"examples.transforms:{description.name}",
            "LEGACY_MODEL_NAME": description.name, "LEGACY_TOP_K": str(description.top_k),
            "LEGACY_SCORES": description.scores}
        served = launch.start_legacy_app(run.logs, model_pt=model_pt, labels=labels, threads=run.args.legacy_threads,
                                         env=legacy_env)
        url = served.url
        description = (f"examples/legacy_app.py under gunicorn, 1 worker x {run.args.legacy_threads} threads, "
                       "TorchScript in-process on the CPU (torch's default thread count)")
    # No health endpoint: any contract answer means it is up
    with stack.serving(served, run.stopper, "/", 404) if served else contextlib.nullcontext():
        run.measure(Target("legacy", label, description, url, run.predict_requests(url), b'"predictions"'))


def run_litserve(run: Run, model_pt: Path, labels: Path) -> None:
    """The peer: bench/litserve_app.py (LitServe 0.2.19, batches of 8 within 10 ms, the legacy transform)."""
    port = launch.free_port()
    env = {**os.environ, "LITSERVE_MODEL_PATH": str(model_pt), "LITSERVE_LABELS_PATH": str(labels),
           "LITSERVE_PORT": str(port)}
    print("starting LitServe ...", flush=True)
    served = launch.ServedApp("litserve", [sys.executable, "-m", "bench.litserve_app"], env, port,
                              run.logs / f"litserve-{port}.log")

    def stop() -> None:  # LitServe's API server and inference processes outlive its main one: the whole group
        served.stop()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(served.process.pid, signal.SIGKILL)

    with stack.serving(served, run.stopper, "/health", timeout_s=240, stop=stop):
        run.measure(Target("litserve", "(4) LitServe 0.2.19, batch 8 / 10 ms",
                           "bench/litserve_app.py: LitServe's own batcher (8 images within 10 ms), one inference "
                           "worker on the CPU, torchvision's transform, TorchScript in-process",
                           served.url, run.predict_requests(served.url), b'"predictions"'))


def shim_target(run: Run, config: str, url: str, triton_url: str, triton_metrics: str | None,
                settings: str) -> Target:
    served = run.served_config(config, triton_url)
    if config == "triton-instances":
        groups = run.triton_configs[config].get("instance_group") or [{}]
        count = sum(int(g.get("count", 1)) for g in groups)  # the CPU copy may run one wide instance instead
        label = f"(2) shim -> Triton, {count} instance{'s' * (count > 1)}"
    else:  # from what Triton serves: an external Triton has its own config
        batching = "dynamic_batching" in run.triton_configs[config]
        label = f"(3) shim -> Triton, {'dynamic batching' if batching else 'no dynamic batching'}"
    return Target(config, label, f"the shim ({settings}) at {url} -> Triton at {triton_url}: {served}", url,
                  run.predict_requests(url), b'"predictions"', shim_metrics=url.rstrip("/") + "/metrics",
                  triton_metrics=triton_metrics)


def direct_target(run: Run, triton_url: str, triton_metrics: str | None) -> Target:
    served = run.served_config("direct", triton_url)
    return Target("direct", "(0) direct tritonclient -> Triton",
                  f"binary FP32 [1,3,224,224] infer requests (built with tritonclient) straight to Triton at "
                  f"{triton_url}: {served}", f"http://{triton_url}", run.infer_requests(triton_url), b'"outputs"',
                  triton_metrics=triton_metrics)


def local_triton_configs(run: Run, work: Path, model_pt: Path) -> None:
    selected = run.args.selected
    if "triton-instances" in selected:
        with triton_variant(run, work, stack.Variant("instances", 2, dynamic_batching=False), model_pt) as triton, \
                shim(run, triton.http_url, SHIM_MAX_BATCH_SIZE="1") as url:
            run.measure(shim_target(run, "triton-instances", url, triton.http_url, triton.metrics_url,
                                    f"{gunicorn(run)}, its batcher off: SHIM_MAX_BATCH_SIZE=1"))
    if {"direct", "triton-batching"} & set(selected):
        with triton_variant(run, work, stack.Variant("batching", 2, dynamic_batching=True), model_pt) as triton:
            if "direct" in selected:
                run.measure(direct_target(run, triton.http_url, triton.metrics_url))
                run.measure_perf_analyzer(triton.http_url)
            if "triton-batching" in selected:
                with shim(run, triton.http_url) as url:
                    run.measure(shim_target(run, "triton-batching", url, triton.http_url, triton.metrics_url,
                                            f"{gunicorn(run)}, its batcher on: the defaults"))


def external_triton_configs(run: Run) -> None:
    triton_url = run.args.triton_url.split("://", 1)[-1].rstrip("/")
    metrics = run.args.triton_metrics_url or f"http://{stack.split_url(triton_url)[0]}:8002/metrics"
    if stack.scrape(metrics) is None:
        print(f"note: Triton's metrics at {metrics} cannot be read; the breakdown will lack Triton's part", flush=True)
        metrics = None
    if "direct" in run.args.selected:
        run.measure(direct_target(run, triton_url, metrics))
        run.measure_perf_analyzer(triton_url)
    if "triton-batching" in run.args.selected:
        if run.args.shim_url:
            url = run.args.shim_url.rstrip("/")
            run.measure(shim_target(run, "triton-batching", url, triton_url, metrics, "already running, its own "
                                    "settings"))
        else:
            with shim(run, triton_url) as url:
                run.measure(shim_target(run, "triton-batching", url, triton_url, metrics,
                                        f"{gunicorn(run)}, the defaults"))


def plan(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    skipped = {}
    if args.triton_url and "triton-instances" in args.selected:
        skipped["triton-instances"] = ("needs a Triton serving the model without dynamic batching, and --triton-url "
                                       "serves its own config; run without --triton-url, or point --triton-url at "
                                       "such a Triton and pass --configs triton-batching")
    return [c for c in args.selected if c not in skipped], skipped


def front_args(args: argparse.Namespace) -> argparse.Namespace:
    """--both: the front-end part's arguments, its own defaults wherever the command line gave none."""
    front = argparse.Namespace(**vars(args))
    front.frontend = True
    for key, value in (FRONT_QUICK if args.quick else FRONT_DEFAULTS).items():
        if key not in args.explicit:
            setattr(front, key, value)
    front.levels = levels(front.concurrency)
    front.legacy_threads = args.legacy_threads if "legacy_threads" in args.explicit else 8
    return front


def classic(args: argparse.Namespace, argv: Sequence[str] | None) -> tuple[int, Path, stack.Stopper]:
    """The Flask-vs-Triton benchmark: (exit status, its output folder, the servers still stopping)."""
    started = Started.now(argv)
    if args.description is not None:
        arch = args.description.name
        model_source = f"{args.description.path}: {args.description}"
    elif args.model_pt is not None:
        arch = stack.model_arch(args.model_pt)
        model_source = f"{args.model_pt}"
    else:
        arch = args.arch
        model_source = "seeded weights: real shapes and speed, meaningless predictions"
    out = (args.out or ROOT / "bench" / "out" / f"{started.stamp:%Y%m%d-%H%M%S}-{arch}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    configs, skipped = plan(args)
    runs = len(configs) * len(args.levels)
    expected = (runs * (args.warmup + args.duration) + len(args.levels) * (ceiling_s(args) + 0.5)
                + STARTUP_ALLOWANCE_S)
    print(f"benchmark: {arch}, configurations {', '.join(configs) or 'none'}, clients {args.levels}, "
          f"{args.warmup:g} s warm-up + {args.duration:g} s per row: {runs} rows, about {expected / 60:.0f} min; "
          f"output in {out}", flush=True)
    for config, reason in skipped.items():
        print(f"skipping {config}: {reason}", flush=True)
    if args.triton_url:
        print(f"using the Triton at {args.triton_url}: no local Triton is started", flush=True)

    if args.model_pt is not None:
        model_pt = args.model_pt.resolve()
    else:
        print(f"exporting {arch} (seeded) into {stack.MODEL_CACHE} ...", flush=True)
        model_pt = stack.exported_model(arch)
    work = Path(tempfile.mkdtemp(prefix="shim-bench-"))
    labels = work / "labels.txt"
    if args.description is not None:
        shutil.copyfile(args.description.labels, labels)
    else:
        write_labels(arch if arch in ("resnet18", "resnet50") else "resnet50", labels)

    notes: list[str] = []
    machine = stack.machine_info()
    with LoadGenerator(args.loadgen_processes) as loadgen:
        run = Run(args, out, loadgen)
        try:
            print("measuring the load generator's own ceiling against a stub server ...", flush=True)
            with StubServer() as stub:
                ceiling = run.ceiling(stub.port, tensors="direct" in configs)
            if "legacy" in configs:
                run_legacy(run, model_pt, labels)
            if "litserve" in configs:
                run_litserve(run, model_pt, labels)
            if args.triton_url:
                external_triton_configs(run)
                notes.append(f"Triton was the one already running at {args.triton_url} (its own model and config); "
                             "configurations that need a Triton started with a given config were skipped.")
            else:
                local_triton_configs(run, work, model_pt)
                notes.append("Triton was the wheel's (nvidia-pytriton), serving a CPU copy of each variant: the "
                             "libtorch model runs in a python-backend stand-in loading the same model.pt, "
                             "KIND_GPU became KIND_CPU, its instances on cores / instances threads each, or one "
                             "instance on every core where this CPU runs that faster (devstack/cpu_layout.py).")
        finally:
            run.stopper.later(lambda: shutil.rmtree(work, ignore_errors=True))  # after the servers using it
            run.close(settle=not args.both)  # --both: the front-end rows' setup overlaps the last stops

    notes += short_warmup_notes(run.rows, args.warmup)
    if not args.triton_url and machine["usable_cores"] and machine["usable_cores"] <= 4:
        notes.append(f"Only {machine['usable_cores']} CPU cores: the load generator, the server under test and "
                     "(for the shim) Triton share them, so every configuration is bounded by the same CPU.")
    report = run.report(started, machine, notes, {},
                        model={"arch": arch, "source": model_source, "file": str(model_pt), "name": args.model_name},
                        seed_rows=[dict(r) for r in SEED_ROWS], skipped=skipped, ceiling_duration_s=ceiling_s(args),
                        loadgen_ceiling=ceiling, ratios=ratios(run.rows), perf_analyzer=run.perf_analyzer)
    gpu = ", ".join(g["name"] for g in machine["gpus"]) or "no GPU"
    plot(run.rows, out / "results.png", f"{arch}, {machine['cpu']}, {machine['usable_cores']} cores, {gpu}")
    latest = out.parent / "latest"
    if out.parent == (ROOT / "bench" / "out").resolve():
        with contextlib.suppress(OSError):
            if latest.is_symlink():
                latest.unlink()
            latest.symlink_to(out.name)
    return finish(run, report, markdown, started, f"{out / 'results.png'}, "), out, run.stopper


def finish(run: Run, report: dict[str, Any], render: Callable[[dict[str, Any]], str], started: Started,
           files: str = "") -> int:
    """Writes results.json and results.md and prints the tables: 1 when a request failed."""
    machine, out = report["machine"], run.out
    if run.triton_server:
        machine["triton_server"] = {k: run.triton_server.get(k) for k in ("name", "version")}
    machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    (out / "results.json").write_text(json.dumps(report, indent=2))
    text = render(report)
    (out / "results.md").write_text(text)
    print()
    print(text)
    errors = sum(r["errors"] + r.get("warmup_errors", 0) for r in run.rows)
    print(f"written: {out / 'results.json'}, {out / 'results.md'}, {files}{out / 'requests.csv'} "
          f"({time.monotonic() - started.at:.0f} s)")
    if errors:
        print(f"{errors} requests failed: see the tables and {out / 'logs'}", file=sys.stderr)
    return 1 if errors else 0
