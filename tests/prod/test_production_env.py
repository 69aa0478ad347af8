"""The production shim's packages against the dev environment's references, across two virtualenvs.

`make test-prod` runs this module in .venv-prod: requirements/prod-test.txt, i.e. the production image's
packages (requirements/shim.txt: numpy 2, no torch, no Triton) and pytest, on the newest Python here. The
references run in .venv (numpy 1.26, torch, the nvidia-pytriton wheel), by its own interpreter:

  * what runs here is what the production image installs, package by package;
  * the shim's preprocessing on numpy 2 gives torchvision's tensor bit for bit (torchvision in .venv);
  * /predict, served by this environment's gunicorn, through .venv's embedded Triton.

Collected only there (tests/conftest.py): in .venv it would compare the environment with itself.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from app.preprocess import ImageSpec, decode, to_tensor
from app.scores import best, softmax
from devstack import launch
from devstack.waiting import wait_for_http
from requirements.lock import read_pins
from tests.support import ROOT, encode, photo
from tests.uploads import valid_uploads

pytestmark = [pytest.mark.prod, pytest.mark.integration]

DEV_PYTHON = ROOT / ".venv" / "bin" / "python"
SIZES = [(640, 480), (480, 640), (256, 256), (224, 224), (257, 300), (1, 1), (3, 700), (1999, 1001), (225, 10)]


def dev(code: str, *args: str | Path, timeout_s: float = 300) -> str:
    """Run `code` with .venv's interpreter (from the repository root); its stdout."""
    if not DEV_PYTHON.exists():
        raise AssertionError(f"{DEV_PYTHON} is missing: make test-prod needs the dev environment (make install)")
    result = subprocess.run([str(DEV_PYTHON), "-c", code, *map(str, args)], cwd=ROOT, capture_output=True,
                            text=True, timeout=timeout_s, check=False)
    assert result.returncode == 0, f".venv's python failed:\n{result.stderr[-3000:]}"
    return result.stdout


def test_the_packages_here_are_the_production_images() -> None:
    """Every package of requirements/shim.txt at its locked version; numpy 2; no torch and no Triton."""
    wrong = []
    for pin in read_pins(ROOT / "requirements" / "shim.txt"):
        requirement, _, marker = pin.line.partition(";")
        version = requirement.split("==")[1].strip()
        try:
            installed: str | None = importlib.metadata.version(pin.name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        # A pin with a marker (Windows only, Python < 3.13 only, ...) may be absent; installed, it must match.
        if installed != version and (installed is not None or not marker.strip()):
            wrong.append(f"{pin.name}: locked {version}, installed {installed}")
    assert not wrong, "this environment is not the production lock: " + "; ".join(wrong)
    assert np.__version__.startswith("2."), np.__version__
    assert [m for m in ("torch", "torchvision", "pytriton", "grpc") if importlib.util.find_spec(m)] == []


def test_preprocessing_on_numpy_2_gives_torchvisions_tensor_bit_for_bit(tmp_path: Path) -> None:
    """The legacy app's torchvision transforms (in .venv) and the shim's Pillow + numpy (here), on the same
    files: photos of awkward sizes and every image kind the contract accepts."""
    files = {f"photo {w}x{h}": encode(photo(w, h, seed=w + h), "PNG") for w, h in SIZES}
    files |= {f"upload {u.name}": u.files["image"][1] for u in valid_uploads()}  # type: ignore[index]
    names = sorted(files)
    for i, name in enumerate(names):
        (tmp_path / f"{i}.img").write_bytes(files[name])
    dev("""
import io, sys
from pathlib import Path
import numpy as np
from PIL import Image
from tests.support import reference_transform
folder, count = Path(sys.argv[1]), int(sys.argv[2])
for i in range(count):
    image = Image.open(io.BytesIO((folder / f"{i}.img").read_bytes())).convert("RGB")
    np.save(folder / f"{i}.npy", reference_transform()(image))
""", tmp_path, len(names))
    spec = ImageSpec()
    differ = []
    for i, name in enumerate(names):
        ours, theirs = to_tensor(decode(files[name], spec), spec), np.load(tmp_path / f"{i}.npy")
        if ours.shape != theirs.shape or ours.dtype != theirs.dtype or not np.array_equal(ours, theirs):
            diff = np.abs(ours.astype(np.float64) - theirs).max() if ours.shape == theirs.shape else "shape"
            differ.append(f"{name}: {ours.shape} {ours.dtype} vs {theirs.shape} {theirs.dtype}, max diff {diff}")
    assert not differ, "numpy " + np.__version__ + " changed the tensor: " + "; ".join(differ)


@pytest.fixture(scope="module")
def dev_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """.venv's embedded Triton (the wheel's server, numpy 1.26) serving modelrepo/standin.py's numpy copy
    of triton_repo: the committed configs, with a near-free `resnet50` whose answer is a formula."""
    work = tmp_path_factory.mktemp("dev-triton")
    repo = work / "repo"
    dev("import runpy, sys; sys.argv = ['standin_repo', sys.argv[1]]; runpy.run_path('modelrepo/standin.py', "
        "run_name='__main__')", repo)
    http, grpc, metrics = (launch.free_port() for _ in range(3))
    log = (work / "triton.log").open("wb")
    server = subprocess.Popen([str(DEV_PYTHON), "-m", "devstack", "--model-repository", str(repo),
                               "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                               "--cache-dir", str(work / "cache"), "--quiet"],
                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{http}"
    try:
        wait_for_http(url + "/v2/health/ready", 300, what="the dev environment's Triton to be ready",
                      give_up=lambda: None if server.poll() is None else
                      f"it exited ({server.returncode}):\n{(work / 'triton.log').read_text()[-3000:]}")
        yield url, repo
    finally:
        server.send_signal(signal.SIGTERM)  # devstack stops the server and removes its shm files
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


def standin_logits(tensor: np.ndarray, classes: int) -> np.ndarray:
    """modelrepo/triton_models/near_free_classifier.py's answer for one image: logit k is the sum of the k-th of
    `classes` equal slices of the flattened input."""
    flat = tensor.reshape(1, -1).astype(np.float32)
    bounds = np.linspace(0, flat.shape[1], classes + 1)[:-1].astype(np.int64)
    return np.add.reduceat(flat, bounds, axis=1)[0]


def test_predict_through_the_dev_environments_triton(dev_triton: tuple[str, Path], tmp_path: Path) -> None:
    """This environment's gunicorn and shim (numpy 2, the production tritonclient) in triton mode, against
    the wheel's Triton of .venv: the answer is the stand-in model's formula on the shim's own tensor."""
    import urllib3

    url, repo = dev_triton
    shim = launch.start_shim(tmp_path, {"SHIM_MODE": "triton", "SHIM_TRITON_URL": url, "SHIM_WORKERS": "1",
                                        "SHIM_MODEL_REPOSITORY": str(repo)})
    try:
        shim.wait("/readyz")
        jpeg = encode(photo(640, 480, seed=7), "JPEG", quality=90)
        answer = urllib3.request("POST", shim.url + "/predict", fields={"image": ("photo.jpg", jpeg, "image/jpeg")},
                                 timeout=60)
        assert answer.status == 200, answer.data[:500]
        body = json.loads(answer.data)
        labels = (repo / "resnet50" / "labels.txt").read_text().splitlines()
        spec = ImageSpec()
        probs = softmax(standin_logits(to_tensor(decode(jpeg, spec), spec), len(labels)))
        want = best(probs, len(body["predictions"]))
        assert [p["class_id"] for p in body["predictions"]] == want, body
        assert [p["label"] for p in body["predictions"]] == [labels[i] for i in want]
        np.testing.assert_allclose([p["score"] for p in body["predictions"]], probs[want], rtol=1e-5)
        assert len(body["predictions"]) >= 1 and body["model"] == "resnet50"
    except BaseException:
        print(shim.log(), file=sys.stderr)
        raise
    finally:
        shim.stop()

