"""modelrepo/check.py: each model the tests use and each form teams write (a weight preset, transforms v2, a
squash to a fixed size, a non-square input), its legacy transform against the shim, on generated images.

PASS needs every tensor bit-exact (or within one pixel level where v2 resizes the tensor: the description's
stated tolerance); a step the shim cannot reproduce is named (a Lambda, a ColorJitter, a module); and advice is
printed only when the check, run again with it, passes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torchvision import transforms
from torchvision.transforms import InterpolationMode, v2

from app.description import load
from examples import transforms as team
from modelrepo.check import FAIL, PASS, USAGE, check, main
from tests.integration.test_encoded import kinds
from tests.support import ROOT, TRITON_REPO, encode, photo
from tests.uploads import valid_uploads

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
# Every model the tests serve (tests/conftest.py) and every form of examples/: the description, and the
# transform of its legacy app (examples/transforms.py, same name).
MODELS = {"resnet50": TRITON_REPO / "resnet50" / "model.toml",
          **{name: ROOT / "examples" / "models" / name / "model.toml"
             for name in ("efficientnet_lite0", "mobilenet_v3_small", "preset_app", "v2_app", "squash_app",
                          "wide_app")}}
# The images of every kind the contract tests upload, and photos of odd sizes.
IMAGES = [(u.name, u.files["image"][1]) for u in valid_uploads() if "4000x3000" not in u.name] + [
    (f"kind {k}", v) for k, v in kinds().items()] + [
    (f"photo {w}x{h}", encode(photo(w, h, seed=w + h))) for w, h in ((301, 227), (227, 301), (233, 232), (10, 500))]
FEW = IMAGES[:4]


@pytest.mark.parametrize("model", MODELS)
def test_each_forms_legacy_transform_passes(model: str) -> None:
    description = load(MODELS[model])
    result = check(getattr(team, model), description, IMAGES)
    assert result.passed, "\n".join(result.lines())
    assert len(result.compared) == len(IMAGES)
    if description.resize_on == "pil":
        assert result.lines()[-1] == f"PASS: {len(IMAGES)} images, every tensor bit-exact (max difference 0)"
    else:  # v2's tensor resize: torch's antialiased filter against Pillow's, at most one pixel level apart
        assert 0 < result.worst <= description.tolerance < 1 / 255 / min(description.std) * 1.01
        assert "<= the tolerance" in result.lines()[-1]


def fixed(model: str, **changes: Any) -> Any:
    """The model's description with [preprocess] fields changed, as a user who got one wrong wrote it."""
    d = load(MODELS[model])
    return dataclasses.replace(d, **changes)


def applied(result: Any, model: str, tmp_path: Path, wrong: str) -> Any:
    """The description file with the check's advice applied, as the user would edit it."""
    import tomllib

    raw = tomllib.loads(wrong)
    folder = tmp_path / raw["name"]
    folder.mkdir(parents=True, exist_ok=True)
    for line in result.advice:
        key, _, value = line.partition(" = ")
        raw.setdefault("preprocess", {})[key] = tomllib.loads(f"v = {value}")["v"]
    text = "\n".join(_toml_table(raw))
    (folder / "model.toml").write_text(text)
    return load(folder / "model.toml")


def _toml_table(raw: dict[str, Any]) -> list[str]:
    import json

    lines = [f"{k} = {json.dumps(v)}" for k, v in raw.items() if not isinstance(v, dict)]
    for section, table in raw.items():
        if isinstance(table, dict):
            lines.append(f"[{section}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    return lines


# One wrong field per form: the check fails, its advice names the field, and with the advice applied it passes.
WRONG = [("preset_app", "resize = 232", "resize = 256", "resize = 232"),
         ("preset_app", 'interpolation = "bilinear"', 'interpolation = "bicubic"', 'interpolation = "bilinear"'),
         ("v2_app", 'resize_on = "tensor"', 'resize_on = "pil"', 'resize_on = "tensor"'),
         ("v2_app", 'to_float = "multiply"', 'to_float = "divide"', 'to_float = "multiply"'),
         ("squash_app", "resize = [224, 224]", "resize = 224\ncrop = 224", "resize = [224, 224]"),
         ("wide_app", "crop = [224, 288]", "crop = [224, 280]", "crop = [224, 288]"),
         ("wide_app", "mean = [0.485, 0.456, 0.406]", "mean = [0.5, 0.5, 0.5]", "mean = [0.485, 0.456, 0.406]")]


@pytest.mark.parametrize(("model", "right", "wrong", "advice"), WRONG, ids=[f"{m}-{w}" for m, _, w, _ in WRONG])
def test_a_wrong_field_fails_with_advice_that_makes_it_pass(model: str, right: str, wrong: str, advice: str,
                                                           tmp_path: Path) -> None:
    text = MODELS[model].read_text()
    assert right in text
    folder = tmp_path / model
    folder.mkdir()
    (folder / "model.toml").write_text(text.replace(right, wrong))
    result = check(getattr(team, model), load(folder / "model.toml"), FEW)
    lines = "\n".join(result.lines())
    assert not result.passed and "FAIL:" in lines
    assert f"  set [preprocess] {advice}" in lines and "advice (verified" in lines, lines
    again = check(getattr(team, model), applied(result, model, tmp_path / "fixed", (folder / "model.toml").read_text()),
                  FEW)
    assert again.passed, "\n".join(again.lines())


def test_the_preset_against_the_classic_description_is_advised_its_resize_not_a_mean_of_zeros() -> None:
    result = check(team.preset_app, load(MODELS["resnet50"]), FEW)
    assert result.advice == ["resize = 232"], result.lines()
    assert not any("mean" in line or "std" in line for line in result.lines())


def test_v2_resizing_the_pil_image_before_to_image_is_bit_exact_with_to_float_multiply(tmp_path: Path) -> None:
    pil_first = v2.Compose([v2.Resize(256), v2.CenterCrop(224), v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
                            v2.Normalize(MEAN, STD)])
    result = check(pil_first, load(MODELS["resnet50"]), FEW)
    assert result.advice == ['to_float = "multiply"'], result.lines()
    assert check(pil_first, fixed("resnet50", to_float="multiply"), IMAGES).lines()[-1].endswith(
        "every tensor bit-exact (max difference 0)")


def test_pil_to_tensor_and_convert_image_dtype_and_nested_composes_read_as_to_tensor() -> None:
    nested = transforms.Compose([transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224)]),
                                 v2.Compose([transforms.PILToTensor(), transforms.ConvertImageDtype(torch.float32),
                                             v2.ToPureTensor()]),
                                 transforms.Normalize(MEAN, STD)])
    result = check(nested, load(MODELS["resnet50"]), IMAGES)
    assert result.passed and result.worst == 0, "\n".join(result.lines())


def test_what_the_shim_cannot_reproduce_is_named_and_no_advice_is_given() -> None:
    def to_bgr(tensor: object) -> object:
        return tensor

    class Sharpen(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    pipeline = transforms.Compose([transforms.Resize(232, InterpolationMode.BICUBIC),
                                   transforms.ColorJitter(brightness=0.2), transforms.CenterCrop(224),
                                   transforms.ToTensor(), transforms.Lambda(to_bgr), Sharpen(),
                                   transforms.Normalize(MEAN, STD)])
    result = check(pipeline, load(MODELS["mobilenet_v3_small"]), FEW[:2])
    text = "\n".join(result.lines())
    assert not result.passed and not result.advice
    assert "step 2, transforms.ColorJitter: the shim does not reproduce it" in text, text
    assert "step 5, transforms.Lambda(to_bgr): a function the shim cannot see into" in text, text
    assert "a module (test_what_the_shim_cannot_reproduce_is_named_and_no_advice_is_given.<locals>.Sharpen) the " \
           "shim cannot see into" in text, text
    assert text.splitlines()[-1].startswith("no advice: the transform has steps the shim does not reproduce")


def test_a_tensor_resize_without_antialiasing_is_named_and_no_advice_is_given() -> None:
    no_aa = v2.Compose([v2.ToImage(), v2.Resize(256, antialias=False), v2.CenterCrop(224),
                        v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])
    result = check(no_aa, load(MODELS["v2_app"]), FEW[:2])
    text = "\n".join(result.lines())
    assert not result.passed and not result.advice
    assert "antialias=False on a tensor: torch's resize without antialiasing is not reproduced" in text, text
    assert text.splitlines()[-1].startswith("no advice:")


def test_advice_that_would_not_make_it_pass_is_never_printed() -> None:
    """A Normalize whose forward does something else reads like Normalize(0.5, 0.5); setting mean/std to 0.5 would
    not make it agree, the check tried it, and it says that it has no advice."""

    class Inverted(transforms.Normalize):
        def forward(self, tensor: torch.Tensor) -> torch.Tensor:
            return 1 - super().forward(tensor)

    odd = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(),
                              Inverted([0.5] * 3, [0.5] * 3)])
    result = check(odd, load(MODELS["resnet50"]), FEW[:2])
    text = "\n".join(result.lines())
    assert not result.passed and not result.advice and "set [preprocess]" not in text
    assert "no advice: no value of the description's fields was found" in text, text
    assert "tried: mean = [0.5, 0.5, 0.5], std = [0.5, 0.5, 0.5]" in text, text


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
    out = capsys.readouterr().out
    assert "set [preprocess] resize = 256" in out and "set [preprocess] mean = [0.485, 0.456, 0.406]" in out, out
    assert main(["examples.transforms:nothing", str(folder), *effnet]) == USAGE
    assert "has no attribute 'nothing'" in capsys.readouterr().err
    assert main(["examples.transforms:resnet50", str(tmp_path / "missing"), *effnet]) == USAGE
