"""The forms teams write today (issue 28), each a team app of examples/ served end to end: torchvision's weight
preset (preset_app), transforms v2 resizing the tensor (v2_app), a squash to a fixed size (squash_app), a
non-square input (wide_app). Each is exported from its description (examples/models/<name>/model.toml) into a
repository of their own, served by a Triton of this module's own (the session's stays as it is), and answered by
its own legacy app (examples/legacy_app.py with the form's transform) and by a shim (shadow mode, then triton
by shim-traffic): the same classes through Triton and through the legacy backend. The encoded transport's decode
step, generated from the same description, serves v2_app (torch's own tensor resize: the legacy tensor exactly),
squash_app (a fixed size) and wide_app (non-square), those two within the step's pixel levels.
"""

from __future__ import annotations

import io
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import requests
from PIL import Image

from app.description import ModelDescription, load
from devstack import EmbeddedTriton, launch
from devstack.launch import ServedApp
from tests.conftest import shim_traffic, start_triton, stop_soon
from tests.integration.test_encoded import decode_step
from tests.support import wait_until
from tests.uploads import valid_uploads

pytestmark = pytest.mark.triton
FORMS = ("preset_app", "v2_app", "squash_app", "wide_app")
# a decode step per resize kind: torch's own on the tensor, a fixed size, non-square (the preset is the classic's)
ENCODED_FORMS = ("v2_app", "squash_app", "wide_app")
UPLOADS = valid_uploads()
SCORE_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def forms_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The forms exported once (bench.reference_model's cache, kept while current), copied with their model.pt
    linked; the shared normalize step is the cache's; decode steps only for ENCODED_FORMS."""
    from bench.reference_model import REPO, export_example

    for name in FORMS:
        export_example(name, REPO)
    repo = tmp_path_factory.mktemp("forms") / "repo"
    repo.mkdir()
    left_out = {f"{name}_{suffix}" for name in set(FORMS) - set(ENCODED_FORMS) for suffix in ("decode", "encoded")}
    for folder in sorted(REPO.iterdir()):
        if folder.name not in left_out and (folder.name.startswith(FORMS) or folder.name == "normalize"):
            shutil.copytree(folder, repo / folder.name, symlinks=True,
                            ignore=shutil.ignore_patterns("model.pt", "__pycache__"))
            for model_pt in folder.glob("[0-9]*/model.pt"):
                (repo / folder.name / model_pt.parent.name / "model.pt").symlink_to(model_pt)
    return repo


@pytest.fixture(scope="module")
def forms_triton(forms_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedTriton]:
    server = start_triton(forms_repo, tmp_path_factory.mktemp("forms-triton-cache"))
    yield server
    stop_soon(server)


@dataclass
class Form:
    description: ModelDescription
    legacy_app: ServedApp
    shim: ServedApp
    flag_file: Path

    @property
    def name(self) -> str:
        return self.description.name


@pytest.fixture(scope="module", params=FORMS)
def form(request: pytest.FixtureRequest, forms_triton: EmbeddedTriton, forms_repo: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Form]:
    name = request.param
    description = load(forms_repo / name / "model.toml")
    logs = tmp_path_factory.mktemp(f"form-{name}")
    legacy = launch.start_legacy_app(logs, model_pt=description.model_file(), labels=description.labels, env={
        "LEGACY_TRANSFORM": f"examples.transforms:{name}", "LEGACY_MODEL_NAME": name,
        "LEGACY_TOP_K": str(description.top_k), "LEGACY_SCORES": description.scores})
    flag_file = logs / "traffic.json"
    shim = launch.start_shim(logs, {"SHIM_TRITON_URL": forms_triton.http_url, "SHIM_MODEL_REPOSITORY": str(forms_repo),
                                    "SHIM_MODEL_NAME": name, "SHIM_MODE": "shadow", "SHIM_FLAG_FILE": str(flag_file),
                                    "SHIM_WORKERS": "1", "SHIM_TRITON_TIMEOUT_S": "60"})
    try:
        legacy.wait("/", status=404)
        shim.wait("/readyz")
        wait_until(lambda: bool(requests.get(shim.url + "/readyz", timeout=10).json().get("backends", {})
                                .get("triton", {}).get("ready")), 120, f"the {name} shim's Triton backend")
        yield Form(description, legacy, shim, flag_file)
    finally:
        stop_soon(shim)
        stop_soon(legacy)


def same_answer(want: dict, got: dict, exact: bool, what: object) -> None:
    """exact: the same top-k classes in order with scores within SCORE_TOLERANCE (the tensor was the legacy one);
    else (v2's tensor resize, within a pixel level): the same top-1 class, scores within 0.01."""
    theirs, mine = want["predictions"], got["predictions"]
    assert got["model"] == want["model"]
    if exact:
        assert [p["class_id"] for p in mine] == [p["class_id"] for p in theirs], what
        assert all(abs(a["score"] - b["score"]) <= SCORE_TOLERANCE for a, b in zip(theirs, mine, strict=True)), what
    else:
        assert mine[0]["class_id"] == theirs[0]["class_id"], what
        assert abs(mine[0]["score"] - theirs[0]["score"]) < 0.01, what


def test_each_form_answers_like_its_own_legacy_app_through_triton_and_legacy(form: Form) -> None:
    references = {}
    for upload in UPLOADS:
        reference = upload.send(form.legacy_app.url)
        assert reference.status_code == 200, reference.text
        references[upload.name] = reference.json()
    for mode, backend in (("shadow", "legacy"), ("triton", "triton")):  # shadow mode answers from legacy
        shim_traffic(form.flag_file, form.description.folder.parent, "set", mode, model_name=form.name)
        wait_until(lambda b=backend: UPLOADS[0].send(form.shim.url).headers.get("X-Shim-Backend") == b, 30,
                   f"answers from {backend} after shim-traffic set {mode}")
        for upload in UPLOADS:
            answer = upload.send(form.shim.url)
            assert answer.status_code == 200 and answer.headers["X-Shim-Backend"] == backend, (backend, answer.text)
            same_answer(references[upload.name], answer.json(), form.description.resize_on == "pil",
                        (backend, upload.name))


def test_triton_serves_the_forms_input_shape_and_preprocessing(form: Form, forms_triton: EmbeddedTriton) -> None:
    served = requests.get(f"http://{forms_triton.http_url}/v2/models/{form.name}/config", timeout=10).json()
    assert [int(d) for d in served["input"][0]["dims"]] == list(form.description.input_shape)
    params = {k: v["string_value"] for k, v in served["parameters"].items()}
    assert {k: params[k] for k in form.description.parameters()} == form.description.parameters()


def test_the_encoded_transport_serves_the_form(form: Form, forms_triton: EmbeddedTriton,
                                               tmp_path_factory: pytest.TempPathFactory) -> None:
    """v2_app: the decode step resizes the uint8 tensor with v2's own resize, so its tensor is the legacy app's
    exactly; squash_app and wide_app (a fixed size, a non-square input): within two pixel levels (the step's
    torch resize against Pillow's, tests/unit/test_decode_step.py)."""
    import tritonclient.http as httpclient

    from app.preprocess import ImageSpec, decode, to_tensor
    from examples import transforms as team
    from tests.integration.test_encoded import kinds

    d = form.description
    if form.name not in ENCODED_FORMS:
        pytest.skip("the forms' Triton serves the encoded transport of ENCODED_FORMS")
    client = httpclient.InferenceServerClient(forms_triton.http_url, network_timeout=60)
    try:
        for name, data in kinds().items():
            got = decode_step(client, data, d.decode_model)[0]
            if d.resize_on == "tensor":
                want = getattr(team, d.name)(Image.open(io.BytesIO(data)).convert("RGB")).numpy()
                np.testing.assert_array_equal(got, want, err_msg=name)
            else:
                want = to_tensor(decode(data, ImageSpec.of(d)), ImageSpec.of(d))
                assert got.shape == want.shape == d.input_shape
                assert np.abs(got - want).max() <= 2 / 255 / min(d.std) * 1.001, name
    finally:
        client.close()
    shim = launch.start_shim(tmp_path_factory.mktemp(f"encoded-{d.name}"), {
        "SHIM_TRITON_URL": forms_triton.http_url, "SHIM_MODEL_REPOSITORY": str(d.folder.parent),
        "SHIM_MODEL_NAME": d.name, "SHIM_MODE": "triton", "SHIM_TRANSPORT": "encoded", "SHIM_WORKERS": "1",
        "SHIM_TRITON_TIMEOUT_S": "60"})
    try:
        shim.wait("/readyz")
        assert requests.get(shim.url + "/readyz", timeout=10).json()["transport"] == "encoded"
        for upload in UPLOADS[:4]:
            got = upload.send(shim.url)
            want = upload.send(form.legacy_app.url)
            assert got.status_code == want.status_code == 200, (upload.name, got.text)
            assert got.headers["X-Shim-Backend"] == "triton"
            # top-1: an upload the shim decodes itself (not a plain JPEG) is resized with Pillow, within a level
            same_answer(want.json(), got.json(), False, upload.name)
    finally:
        stop_soon(shim)
