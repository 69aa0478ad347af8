"""modelrepo/check.py: each model the tests use, its legacy transform against the shim, on generated images.

PASS needs every tensor bit-exact; a step the shim cannot reproduce is named (a Lambda, a ColorJitter), as is
a value that differs from the description, with the field to set.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from app.description import load
from examples import transforms as team
from modelrepo.check import FAIL, PASS, USAGE, check, main
from tests.support import ROOT, TRITON_REPO, encode, photo
from tests.uploads import valid_uploads

# Every model the tests serve (tests/conftest.py): the description, and the transform of its legacy app.
MODELS = {"resnet50": TRITON_REPO / "resnet50" / "model.toml",
          "efficientnet_lite0": ROOT / "examples" / "models" / "efficientnet_lite0" / "model.toml",
          "mobilenet_v3_small": ROOT / "examples" / "models" / "mobilenet_v3_small" / "model.toml"}
IMAGES = [(u.name, u.files["image"][1]) for u in valid_uploads() if "4000x3000" not in u.name] + [
    (f"photo {w}x{h}", encode(photo(w, h, seed=w + h))) for w, h in ((301, 227), (227, 301), (233, 232), (10, 500))]


@pytest.mark.parametrize("model", MODELS)
def test_each_models_legacy_transform_passes_bit_exact(model: str) -> None:
    result = check(getattr(team, model), load(MODELS[model]), IMAGES)
    assert result.passed, "\n".join(result.lines())
    assert len(result.compared) == len(IMAGES) and all(c.max_diff == 0 for c in result.compared)
    assert result.lines()[-1] == f"PASS: {len(IMAGES)} images, every tensor bit-exact (max difference 0)"


def test_a_lambda_and_a_color_jitter_are_named_never_approximated() -> None:
    from torchvision import transforms

    def to_bgr(tensor: object) -> object:
        return tensor

    pipeline = transforms.Compose([transforms.Resize(232, transforms.InterpolationMode.BICUBIC),
                                   transforms.ColorJitter(brightness=0.2), transforms.CenterCrop(224),
                                   transforms.ToTensor(), transforms.Lambda(to_bgr),
                                   transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    result = check(pipeline, load(MODELS["mobilenet_v3_small"]), IMAGES[:3])
    assert not result.passed
    text = "\n".join(result.lines())
    assert "step 2, transforms.ColorJitter: the shim does not reproduce it" in text, text
    assert "step 5, transforms.Lambda(to_bgr): a function the shim cannot see into" in text, text
    assert text.splitlines()[-1].startswith("  - ") and "FAIL:" in text


def test_a_value_that_differs_names_the_field_to_set() -> None:
    result = check(team.resnet50, load(MODELS["mobilenet_v3_small"]), IMAGES[:4])
    assert not result.passed
    text = "\n".join(result.lines())
    assert "Resize's size: the legacy transform has 256, " in text and "set [preprocess] resize = 256" in text
    assert 'set [preprocess] interpolation = "bilinear"' in text
    assert "DIFFERS" in text


def test_the_command_exits_0_on_pass_1_on_fail_2_when_it_cannot_run(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "images"
    folder.mkdir()
    for name, data in IMAGES[:3]:
        (folder / f"{name.replace(' ', '_')}.img").write_bytes(data)
    effnet = ["--description", str(MODELS["efficientnet_lite0"])]
    assert main(["examples.transforms:efficientnet_lite0", str(folder), *effnet]) == PASS
    assert capsys.readouterr().out.strip().endswith("PASS: 3 images, every tensor bit-exact (max difference 0)")
    assert main(["examples.transforms:resnet50", str(folder), *effnet]) == FAIL
    assert "set [preprocess] mean = [0.485, 0.456, 0.406]" in capsys.readouterr().out
    assert main(["examples.transforms:nothing", str(folder), *effnet]) == USAGE
    assert "has no attribute 'nothing'" in capsys.readouterr().err
    assert main(["examples.transforms:resnet50", str(tmp_path / "missing"), *effnet]) == USAGE
