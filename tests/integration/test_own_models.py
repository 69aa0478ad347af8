"""Two classifiers other than resnet50, each with its own preprocessing, labels and legacy app, end to end.

EfficientNet-Lite0 (pretrained, from PyPI; Resize(224), mean/std 127/255 and 128/255) and mobilenet_v3_small
(10 classes, Resize(232, BICUBIC), seeded), both served by the session's Triton beside resnet50, each from its
description (examples/models/<name>/model.toml, exported by modelrepo/export.py). Per model: the legacy app
(examples/legacy_app.py with that model's own torchvision transform, examples/transforms.py) and one shim
(SHIM_MODEL_NAME=<name>, shadow mode, then triton mode by shim-traffic) answer the same uploads the same way
through the legacy backend and through Triton; shadow comparisons match; the uint8
ensemble with the model's own normalize step gives the tensors' answers. The migration report and the
benchmark run against mobilenet_v3_small. The encoded transport, generated from EfficientNet-Lite0's description
(efficientnet_lite0_decode -> efficientnet_lite0), answers like that model's legacy app, and readiness checks
its decode step's parameters against the shim's description.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import requests

from app.description import ModelDescription, load
from app.preprocess import ImageSpec, crop, decode, normalize
from devstack import EmbeddedTriton, launch
from devstack.launch import ServedApp
from devstack.promtext import scrape, total
from tests.conftest import ENCODED_OWN_MODELS, OWN_MODELS, shim_traffic, stop_soon
from tests.integration.test_encoded import decode_step, kinds, metric, triton_count
from tests.support import ROOT, encode, photo, wait_until
from tests.uploads import Upload, valid_uploads

pytestmark = pytest.mark.triton
SCORE_TOLERANCE = 1e-4
UPLOADS = valid_uploads()


@dataclass
class Own:
    description: ModelDescription
    repo: Path
    legacy_app: ServedApp
    shim: ServedApp
    flag_file: Path

    @property
    def name(self) -> str:
        return self.description.name

    def switch(self, mode: str) -> None:
        """shim-traffic set `mode`, as an operator runs it beside the shim; then wait until answers follow."""
        shim_traffic(self.flag_file, self.repo, "set", mode, model_name=self.name)
        answered_by = "legacy" if mode == "shadow" else mode
        wait_until(lambda: ask(self.shim, UPLOADS[0]).headers.get("X-Shim-Backend") == answered_by, 30,
                   f"answers from {answered_by} after shim-traffic set {mode}")


@pytest.fixture(scope="module", params=OWN_MODELS)
def own(request: pytest.FixtureRequest, triton: EmbeddedTriton, test_repo: Path,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Own]:
    name = request.param
    description = load(test_repo / name / "model.toml")
    logs = tmp_path_factory.mktemp(f"own-{name}")
    flag_file = logs / "traffic.json"
    legacy = launch.start_legacy_app(logs, model_pt=description.model_file(), labels=description.labels, env={
        "LEGACY_TRANSFORM": f"examples.transforms:{name}", "LEGACY_MODEL_NAME": name,
        "LEGACY_TOP_K": str(description.top_k), "LEGACY_SCORES": description.scores})
    shim = launch.start_shim(logs, {"SHIM_TRITON_URL": triton.http_url, "SHIM_MODEL_REPOSITORY": str(test_repo),
                                    "SHIM_MODEL_NAME": name, "SHIM_MODE": "shadow", "SHIM_FLAG_FILE": str(flag_file),
                                    # a slow (shadow) call on this shared machine is not a mismatch
                                    "SHIM_WORKERS": "1", "SHIM_TRITON_TIMEOUT_S": "60"})
    try:
        legacy.wait("/", status=404)
        shim.wait("/readyz")
        wait_until(lambda: _triton_ready(shim), 120, f"the {name} shim's Triton backend to be ready")
        yield Own(description, test_repo, legacy, shim, flag_file)
    finally:
        stop_soon(shim)
        stop_soon(legacy)


def _triton_ready(shim: ServedApp) -> bool:
    body = requests.get(shim.url + "/readyz", timeout=10).json()
    return bool(body.get("backends", {}).get("triton", {}).get("ready"))


def ask(shim: ServedApp, upload: Upload) -> requests.Response:
    return requests.post(shim.url + "/predict", files=upload.files, timeout=120)


@pytest.mark.parametrize("upload", UPLOADS, ids=[u.name for u in UPLOADS])
def test_both_backends_answer_like_the_models_own_legacy_app(own: Own, upload: Upload) -> None:
    reference = upload.send(own.legacy_app.url)
    assert reference.status_code == 200, reference.text
    body = reference.json()
    assert body["model"] == own.name and len(body["predictions"]) == own.description.top_k
    labels = own.description.labels.read_text().splitlines()
    assert all(p["label"] == labels[p["class_id"]] for p in body["predictions"])
    for mode, backend in (("shadow", "legacy"), ("triton", "triton")):
        own.switch(mode)
        answer = ask(own.shim, upload)
        assert answer.status_code == 200, (backend, answer.text)
        assert answer.headers["X-Shim-Backend"] == backend
        got = answer.json()
        assert list(got) == ["model", "predictions"] and got["model"] == own.name
        assert [p["class_id"] for p in got["predictions"]] == [p["class_id"] for p in body["predictions"]], backend
        assert [p["label"] for p in got["predictions"]] == [p["label"] for p in body["predictions"]], backend
        for want, have in zip(body["predictions"], got["predictions"], strict=True):
            assert abs(want["score"] - have["score"]) <= SCORE_TOLERANCE, (backend, want, have)


def test_triton_serves_the_descriptions_preprocessing(own: Own, triton_client: object) -> None:
    served = triton_client.get_model_config(own.name)  # type: ignore[attr-defined]
    params = {k: v["string_value"] for k, v in served["parameters"].items()}
    assert {k: params[k] for k in own.description.parameters()} == own.description.parameters()
    assert served["output"][0]["dims"] == [str(own.description.classes)] or \
        served["output"][0]["dims"] == [own.description.classes]


def test_the_uint8_ensemble_with_the_models_own_normalize_gives_the_tensors_answer(own: Own,
                                                                                   triton_client: object) -> None:
    import tritonclient.http as httpclient

    spec = ImageSpec.of(own.description)
    images = [decode(encode(photo(500 + 40 * i, 380, seed=90 + i)), spec) for i in range(3)]
    pixels = np.stack([crop(image, spec) for image in images])
    tensors = np.stack([normalize(p, spec) for p in pixels])

    def infer(model: str, array: np.ndarray, dtype: str) -> np.ndarray:
        tensor = httpclient.InferInput("input__0", list(array.shape), dtype)
        tensor.set_data_from_numpy(array, binary_data=True)
        result = triton_client.infer(model, [tensor])  # type: ignore[attr-defined]
        return np.asarray(result.as_numpy("output__0"))

    from_tensors = infer(own.name, tensors, "FP32")
    from_pixels = infer(own.description.uint8_model, pixels, "UINT8")
    assert from_tensors.shape == (3, own.description.classes)
    np.testing.assert_array_equal(from_pixels, from_tensors)  # the same tensor reached the model, bit for bit


def test_shadow_mode_compares_this_models_answers_and_they_match(own: Own) -> None:
    def counts() -> dict[str, float]:
        samples = scrape(own.shim.url + "/metrics")
        return {r: total(samples, "shim_shadow_comparisons_total", result=r) for r in ("match", "mismatch", "error",
                                                                                      "skipped")}

    own.switch("shadow")  # its probe requests are shadowed too: let their comparisons land first
    settled = [counts()]
    wait_until(lambda: settled.append(counts()) or settled[-1] == settled[-2], 180, "the probes' comparisons")
    before = settled[-1]
    for i, upload in enumerate(UPLOADS[:4], start=1):  # one at a time: never more shadow calls than it runs at once
        answer = ask(own.shim, upload)
        assert answer.status_code == 200 and answer.headers["X-Shim-Backend"] == "legacy", answer.text
        wait_until(lambda n=i: sum(counts().values()) >= sum(before.values()) + n, 180, f"shadow comparison {i}")
    after = counts()
    new = {r: after[r] - before[r] for r in after}  # a late probe's comparison may land here too: >= 4
    assert new["match"] >= 4 and {r: new[r] for r in ("mismatch", "error", "skipped")} == \
        {"mismatch": 0, "error": 0, "skipped": 0}, new


def test_the_migration_report_is_a_go_for_mobilenet(triton: EmbeddedTriton, test_repo: Path,
                                                    tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    for i in range(4):
        (images / f"{i}.jpg").write_bytes(encode(photo(300 + 50 * i, 240, seed=300 + i)))
    out = tmp_path / "report"
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("SHIM_")}
    done = subprocess.run([sys.executable, "-m", "report", str(images), "--triton-url", triton.http_url,
                           "--model-repository", str(test_repo), "--model", "mobilenet_v3_small", "--warm-up", "1",
                           "--max-p99-ratio", "1000", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr
    text = (out / "report.md").read_text()
    assert "**Verdict: GO**" in text
    assert "mobilenet_v3_small: Resize(232, bicubic), CenterCrop(224)" in text and "10 classes" in text
    assert "top-3 compared" in text


def test_the_benchmark_runs_for_mobilenet(own: Own, triton: EmbeddedTriton, tmp_path: Path) -> None:
    if own.name != "mobilenet_v3_small":
        pytest.skip("one model is enough for the benchmark")
    out = tmp_path / "bench"
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--configs", "legacy,triton-batching,direct",
         "--triton-url", triton.http_url, "--triton-metrics-url", triton.metrics_url,
         "--shim-url", own.shim.url, "--legacy-url", own.legacy_app.url,
         "--model-repository", str(own.repo), "--model-name", own.name,
         "--concurrency", "1", "--warmup", "0.5", "--duration", "1.5", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    assert results["model"]["name"] == "mobilenet_v3_small"
    assert "Resize(232, bicubic)" in results["model"]["source"]  # the description, not an exported ResNet
    rows = {row["config"]: row for row in results["results"]}
    assert set(rows) == {"legacy", "triton-batching", "direct"}, rows.keys()
    assert all(row["errors"] == 0 and row["answers"] > 0 for row in rows.values()), \
        {c: (r["answers"], r["errors"], r["error_kinds"], r["unfinished"]) for c, r in rows.items()}


# -- the encoded transport, generated from the model's description ------------------------------------------------

def test_the_encoded_transport_answers_like_the_models_own_legacy_app(own: Own, triton: EmbeddedTriton,
                                                                      triton_client: object,
                                                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    """EfficientNet-Lite0 (its own Resize(224), mean and std, pretrained): every upload through the shim with
    SHIM_TRANSPORT=encoded gets the legacy app's classes; the JPEGs went to Triton as they came."""
    from app.preprocess import to_tensor
    from app.sniff import cpu_reason

    if own.name not in ENCODED_OWN_MODELS:
        pytest.skip("the session's Triton serves the encoded transport of one own model (tests/conftest.py)")
    d = own.description
    uploads = [(u.name, u.files["image"][1]) for u in UPLOADS] + list(kinds().items())
    forwarded = [(name, data) for name, data in uploads if cpu_reason(data, ImageSpec.of(d)) is None]
    assert len(forwarded) >= 8, [n for n, _ in forwarded]
    shim = launch.start_shim(tmp_path_factory.mktemp(f"encoded-{own.name}"), {
        "SHIM_TRITON_URL": triton.http_url, "SHIM_MODEL_REPOSITORY": str(own.repo), "SHIM_MODEL_NAME": own.name,
        "SHIM_MODE": "triton", "SHIM_TRANSPORT": "encoded", "SHIM_WORKERS": "1", "SHIM_TRITON_TIMEOUT_S": "60"})
    try:
        shim.wait("/readyz")  # triton mode: ready once the ensemble and its decode step's parameters are checked
        readyz = requests.get(shim.url + "/readyz", timeout=10).json()
        assert readyz["transport"] == "encoded" and d.encoded_model in readyz["backends"]["triton"]["detail"], readyz
        sent = triton_count(triton, d.encoded_model)
        worst_score = 0.0
        for name, data in uploads:
            got = requests.post(shim.url + "/predict", files={"image": ("upload", data)}, timeout=120)
            want = requests.post(own.legacy_app.url + "/predict", files={"image": ("upload", data)}, timeout=120)
            assert got.status_code == want.status_code == 200, (name, got.text, want.text)
            assert got.headers["X-Shim-Backend"] == "triton"
            mine, theirs = got.json()["predictions"], want.json()["predictions"]
            assert mine[0] == {**theirs[0], "score": mine[0]["score"]}, name  # the same top-1 class and label
            # The same top-k classes; two whose scores tie within the tensors' noise may swap places below the top.
            assert {(p["class_id"], p["label"]) for p in mine} == {(p["class_id"], p["label"]) for p in theirs}, name
            scores = {p["class_id"]: p["score"] for p in theirs}
            worst_score = max(worst_score, *(abs(p["score"] - scores[p["class_id"]]) for p in mine))
        assert triton_count(triton, d.encoded_model) - sent == len(forwarded)  # the JPEGs went as they came
        assert metric(shim.url, "shim_encoded_cpu_path_total") == len(uploads) - len(forwarded)
        assert worst_score < 0.01, worst_score  # measured: 0.0007 (tensors within one pixel level)
    finally:
        stop_soon(shim)
    # The tensor the decode step made, against the legacy app's: within one pixel level (1/255) everywhere
    # (measured on these 11 JPEGs: at most 0.24 % of the values one level off).
    level = 1 / 255 / max(d.std)
    for name, data in forwarded:
        got = decode_step(triton_client, data, d.decode_model)[0]
        want = to_tensor(decode(data, ImageSpec.of(d)), ImageSpec.of(d))
        assert np.abs(got - want).max() <= level * 1.001, (name, np.abs(got - want).max() / level)


def test_readiness_on_the_encoded_route_checks_the_decode_steps_parameters(own: Own, triton: EmbeddedTriton,
                                                                           tmp_path: Path) -> None:
    """A description that says bicubic where the served decode step was generated with bilinear keeps /readyz at
    503 naming the parameter; one the step cannot reproduce (lanczos) is refused with the reason."""
    import shutil

    from app import create_app
    from app.settings import Mode, Settings

    if own.name not in ENCODED_OWN_MODELS:
        pytest.skip("the session's Triton serves the encoded transport of one own model (tests/conftest.py)")
    folder = tmp_path / own.name
    folder.mkdir()
    shutil.copy(own.description.labels, folder / "labels.txt")
    text = own.description.path.read_text()
    cases = {"bilinear": r"is ready .*transport encoded",
             "bicubic": rf"Triton model '{own.name}_decode' \(the decode step of {own.name}_encoded\) at .* was "
                        r"generated from another description: interpolation='bilinear', the shim's description says "
                        r"'bicubic'\. Regenerate",
             "lanczos": r"interpolation = 'lanczos' is one that Triton's decode step cannot reproduce .* "
                        rf"SHIM_TRANSPORT=encoded cannot serve {own.name}: use SHIM_TRANSPORT=fp32"}
    for interpolation, says in cases.items():
        (folder / "model.toml").write_text(text.replace('interpolation = "bilinear"',
                                                        f'interpolation = "{interpolation}"'))
        app = create_app(Settings(model_repository=tmp_path, model_name=own.name, triton_url=triton.http_url,
                                  transport="encoded", mode=Mode.TRITON, flag_file=tmp_path / f"{interpolation}.json"))
        try:
            answer = app.test_client().get("/readyz")
        finally:
            app.extensions["shim"].close()
        detail = answer.get_json()["backends"]["triton"]["detail"]
        assert answer.status_code == (200 if interpolation == "bilinear" else 503), detail
        assert re.search(says, detail), detail
