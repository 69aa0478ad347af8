"""`python -m bench.agreement`: the encoded transport's answers against the legacy path's, on bench/corpus.py.

Both tensors of every upload (app.preprocess's; Triton's decode step's, or the shim's CPU path's for an upload
app/sniff.py keeps) go through the reference model (bench/reference_model.py). Targets: top-1 agreement >= 99.5 %,
mean top-5 overlap >= 99 %: exit 0 when met, 1 when not. Without --triton-url it starts the wheel's Triton.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from app import scores as score_functions
from app.description import compare_parameters
from app.preprocess import ImageSpec, decode, to_tensor
from app.sniff import cpu_reason
from bench import corpus, reference_model
from modelrepo import generate as model_repo
from report.percentiles import percentile

if TYPE_CHECKING:
    from app.description import ModelDescription

ROOT = Path(__file__).resolve().parent.parent
TOP1_TARGET, TOP5_TARGET = 0.995, 0.99
K = 5


@dataclass(frozen=True)
class Row:
    name: str
    kind: str
    path: str  # "triton" (forwarded and decoded there) or the reason the shim decoded it itself
    max_levels: float  # largest |difference| of a tensor value, in pixel levels
    mean_levels: float
    same_top1: bool
    top5_overlap: float
    score_diff: float = 0.0  # largest |difference| of a class score (the shadow comparison's figure)


class DecodeStep:
    """Triton's decode step, called one upload per request (as the shim sends them), a client per thread."""

    def __init__(self, url: str, model: str, timeout_s: float = 120) -> None:
        import tritonclient.http as httpclient

        self._http, self.url, self.model, self._timeout_s = httpclient, url, model, timeout_s
        self._local = threading.local()
        self._clients: list[Any] = []
        self._lock = threading.Lock()
        config = self._client().get_model_config(model)
        self.parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.instances = config.get("instance_group", [])
        (inp,), (out, *_) = config["input"], config["output"]  # the tensor, then `readable`
        self.input_name, self.output_name = inp["name"], out["name"]

    def check(self, description: ModelDescription) -> None:
        """The step must decode with the description's preprocessing, as the shim checks it at readiness."""
        differ = compare_parameters(self.parameters, description.decode_parameters(), every=True,
                                    described=str(description.path))
        if differ:
            raise ValueError(f"{self.model} at {self.url} does not decode as its description says: "
                             f"{'; '.join(differ)}. Regenerate it (modelrepo/export.py)")

    def _client(self) -> Any:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._http.InferenceServerClient(self.url, network_timeout=self._timeout_s)
            self._local.client = client
            with self._lock:
                self._clients.append(client)
        return client

    def tensor(self, data: bytes) -> np.ndarray | None:
        """The step's FP32 [3, crop, crop] for one upload; None when it refuses the upload."""
        result = self._client().infer(self.model, [bytes_input(self._http, self.input_name, data)])
        if not result.as_numpy("readable")[0, 0]:
            return None
        return np.asarray(result.as_numpy(self.output_name)[0])

    def close(self) -> None:
        for client in self._clients:
            client.close()


def encoded_tensors(items: Sequence[corpus.Item], step: DecodeStep, spec: Any,
                    concurrency: int = 4) -> list[tuple[str, np.ndarray]]:
    """(path, tensor) per item as the encoded transport makes it; several requests in flight, as under load."""
    def one(item: corpus.Item) -> tuple[str, np.ndarray]:
        reason = cpu_reason(item.data, spec)
        if reason is None:
            got = step.tensor(item.data)
            if got is not None:
                return "triton", got
            reason = "decoder_refused"
        return reason, to_tensor(decode(item.data, spec), spec)

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, items))


def logits_of(model: Any, tensors: Sequence[np.ndarray], batch: int = 16) -> np.ndarray:
    import torch

    out = []
    with torch.inference_mode():  # channels-last input: its depthwise convolutions run several times faster
        for start in range(0, len(tensors), batch):
            x = torch.from_numpy(np.stack(tensors[start:start + batch])).contiguous(memory_format=torch.channels_last)
            out.append(model(x).numpy())
    return np.concatenate(out)


def measure(items: Sequence[corpus.Item], step: DecodeStep, description: ModelDescription, *,
            concurrency: int = 4) -> tuple[list[Row], dict[str, Any]]:
    """Every item through both paths and the description's model: one Row each, and the summary."""
    import torch

    step.check(description)
    spec = ImageSpec.of(description)
    started = time.monotonic()
    legacy = [to_tensor(decode(item.data, spec), spec) for item in items]
    encoded = encoded_tensors(items, step, spec, concurrency)
    decoded_s = time.monotonic() - started
    level = 1 / 255 / np.asarray(spec.std, dtype=np.float32)[:, None, None]  # one pixel step, per channel
    levels = [np.abs(got - want) / level for want, (_, got) in zip(legacy, encoded, strict=True)]
    # Equal tensors give equal logits: the model runs on the pairs that differ (what the figures are about).
    differ = [i for i, lv in enumerate(levels) if lv.max() > 0]
    model = torch.jit.optimize_for_inference(
        torch.jit.load(str(description.model_file()), map_location="cpu").eval())
    a = dict(zip(differ, logits_of(model, [legacy[i] for i in differ]), strict=True)) if differ else {}
    b = dict(zip(differ, logits_of(model, [encoded[i][1] for i in differ]), strict=True)) if differ else {}
    scores = {"softmax": score_functions.softmax, "sigmoid": score_functions.sigmoid,
              "probabilities": score_functions.probabilities}[description.scores]
    rows = []
    for i, (item, (path, _)) in enumerate(zip(items, encoded, strict=True)):
        same, overlap, diff = True, 1.0, 0.0
        if i in a:
            top_a, top_b = np.argsort(-a[i])[:K], np.argsort(-b[i])[:K]
            same, overlap = bool(top_a[0] == top_b[0]), len(set(top_a) & set(top_b)) / K
            diff = float(np.abs(scores(a[i]) - scores(b[i])).max())
        rows.append(Row(item.name, item.kind, path, float(levels[i].max()), float(levels[i].mean()), same, overlap,
                        diff))
    summary = summarize(rows, seconds=time.monotonic() - started, decode_s=decoded_s, classified=len(differ))
    summary["model"] = str(description)
    return rows, summary


def summarize(rows: Sequence[Row], **extra: float) -> dict[str, Any]:
    def figures(subset: Sequence[Row]) -> dict[str, Any]:
        return {"images": len(subset), "top1_agreement": float(np.mean([r.same_top1 for r in subset])),
                "top5_overlap": float(np.mean([r.top5_overlap for r in subset])),
                "max_levels": max(r.max_levels for r in subset), "mean_levels": float(np.mean([r.mean_levels
                                                                                               for r in subset])),
                "max_score_diff": max(r.score_diff for r in subset),
                "p99_score_diff": percentile([r.score_diff for r in subset], 99)}

    forwarded = [r for r in rows if r.path == "triton"]
    summary: dict[str, Any] = {"all": figures(rows), "forwarded": figures(forwarded) if forwarded else None,
                               "paths": {p: sum(r.path == p for r in rows) for p in sorted({r.path for r in rows})},
                               "kinds": {kind: {**figures([r for r in rows if r.kind == kind]),
                                                "paths": sorted({r.path for r in rows if r.kind == kind})}
                                         for kind in dict.fromkeys(r.kind for r in rows)},
                               "targets": {"top1_agreement": TOP1_TARGET, "top5_overlap": TOP5_TARGET}, **extra}
    summary["met"] = (summary["all"]["top1_agreement"] >= TOP1_TARGET and summary["all"]["top5_overlap"] >= TOP5_TARGET)
    return summary


def markdown(rows: Sequence[Row], summary: dict[str, Any], where: str) -> str:
    a = summary["all"]
    lines = [f"# Encoded transport: agreement with the legacy path ({where})", "",
             f"{a['images']} generated uploads (bench/corpus.py); reference model {summary.get('model', '?')} "
             "(pretrained), "
             f"run on the {summary['classified']} pairs whose tensors differ (equal tensors give equal answers); "
             f"tensor differences in pixel levels (1 = one step of 0..255). Paths: "
             + ", ".join(f"{p} {n}" for p, n in summary["paths"].items()) + ".", "",
             f"**{'MET' if summary['met'] else 'NOT MET'}**: top-1 agreement {a['top1_agreement']:.2%} (target >= "
             f"{TOP1_TARGET:.1%}), mean top-5 overlap {a['top5_overlap']:.2%} (target >= {TOP5_TARGET:.0%}); "
             f"tensor max {a['max_levels']:.2f}, mean {a['mean_levels']:.4f} levels.", ""]
    if summary["forwarded"]:
        f = summary["forwarded"]
        lines += [f"Forwarded to Triton's decoder alone ({f['images']} uploads): top-1 {f['top1_agreement']:.2%}, "
                  f"top-5 overlap {f['top5_overlap']:.2%}, tensor max {f['max_levels']:.2f}, mean "
                  f"{f['mean_levels']:.4f} levels.", ""]
    lines += ["| kind | images | path | top-1 agreement | mean top-5 overlap | max diff (levels) "
              "| mean diff (levels) |",
              "| --- | --: | --- | --: | --: | --: | --: |"]
    for kind, k in summary["kinds"].items():
        lines.append(f"| {kind} | {k['images']} | {', '.join(k['paths'])} | {k['top1_agreement']:.1%} | "
                     f"{k['top5_overlap']:.1%} | {k['max_levels']:.2f} | {k['mean_levels']:.4f} |")
    differ = [r for r in rows if not r.same_top1]
    if differ:
        lines += ["", "Top-1 differs: " + "; ".join(f"{r.name} (max {r.max_levels:.1f} levels)" for r in differ)]
    return "\n".join(lines) + "\n"


def write_decode_step(description: ModelDescription, repo: Path) -> str:
    """The description's generated decode step (configs and its model.py copy) into `repo`; returns its name."""
    files = model_repo.the_decode_step(description)
    if not files:
        raise ValueError(description.encoded_refusal())
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    return description.decode_model


def main(argv: Sequence[str] | None = None, on_ready: Callable[[DecodeStep], None] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.agreement", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--triton-url", help="a running Triton serving the decode step (default: start the wheel's)")
    p.add_argument("--model", help=f"the decode step's name (default {reference_model.NAME}_decode, generated from "
                                   "the reference model's description)")
    p.add_argument("--limit", type=int, help="only the first N uploads of the corpus")
    p.add_argument("--concurrency", type=int, default=4, help="uploads in flight to Triton (default 4)")
    p.add_argument("--out", type=Path, help="where results.json and results.md go (default bench/out/<time>-agreement)")
    args = p.parse_args(argv)
    out = (args.out or ROOT / "bench" / "out" / f"{time.strftime('%Y%m%d-%H%M%S')}-agreement").resolve()
    out.mkdir(parents=True, exist_ok=True)
    print("agreement: making the corpus (cached in .cache/agreement-corpus) and the reference model ...", flush=True)
    items = corpus.cached(limit=args.limit)
    description = reference_model.reference()
    work = Path(tempfile.mkdtemp(prefix="shim-agreement-"))
    server = None
    try:
        url = args.triton_url
        if url is None:
            from bench import stack

            print("agreement: starting the wheel's Triton with the decode step's CPU copy ...", flush=True)
            write_decode_step(description, work / "repo")  # a repository of the decode step alone
            server = stack.start_triton(work / "repo", work / "triton")
            url = server.http_url
        step = DecodeStep(url, args.model or description.decode_model)
        if on_ready is not None:
            on_ready(step)
        kinds = "/".join(sorted({str(g.get("kind", "?")) for g in step.instances})) or "?"
        rows, summary = measure(items, step, description, concurrency=args.concurrency)
        step.close()
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    where = f"Triton at {url}, {step.model} on {kinds}"
    summary["where"] = where
    (out / "results.json").write_text(json.dumps({"summary": summary, "rows": [r.__dict__ for r in rows]}, indent=2))
    (out / "results.md").write_text(markdown(rows, summary, where))
    print((out / "results.md").read_text())
    print(f"written: {out / 'results.json'}, {out / 'results.md'} ({summary['seconds']:.0f} s)")
    return 0 if summary["met"] else 1


if __name__ == "__main__":
    sys.exit(main())


def bytes_input(httpclient: Any, name: str, data: bytes) -> Any:
    """One upload as the decode step and the encoded ensemble take it: BYTES [1, 1]."""
    tensor = httpclient.InferInput(name, [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[data]], dtype=np.object_), binary_data=True)
    return tensor
