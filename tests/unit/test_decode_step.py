"""The encoded transport's decode step (modelrepo/triton_models/decode.py, copied into every generated <name>_decode)
in this process: its resize, crop and normalise against the shim's own preprocessing (the legacy app's tensor),
for every interpolation it takes, with a model's own geometry, max_size and CenterCrop's padding. Triton's
copy of the same code is run by tests/integration/test_encoded.py and test_own_models.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from app.description import DECODE_PARAMETERS, ENCODED_INTERPOLATIONS, INTERPOLATIONS, ModelDescription, parse
from app.preprocess import ImageSpec, resized_size, to_tensor
from modelrepo import generate as model_repo
from modelrepo.triton_models import decode
from tests.support import photo

# (resize, crop, max_size): mobilenet_v3_small's; EfficientNet-Lite0's (the crop fills the short side); max_size
# shrinking the short side below the crop, where CenterCrop pads with zeros.
GEOMETRIES = [(232, 224, None), (224, 224, None), (160, 200, 180)]
SIZES = [(640, 480), (480, 640), (1, 1), (225, 10), (232, 232), (300, 233), (701, 333), (100, 81)]
# The largest difference from Pillow's filter, in pixel levels (1/255), measured over SIZES x GEOMETRIES: Pillow's
# NEAREST index rule is reproduced exactly; torchvision's antialiased tensor resize is within 1 level of Pillow's
# bilinear and bicubic for most images, 2 for a few (bilinear: a 232x232 image shrunk to 224, 4% of its values;
# bicubic: 225x10 and 100x81 enlarged, under 0.6%).
LEVELS = {"nearest": 0, "nearest-exact": 0, "bilinear": 2, "bicubic": 2}


def description(interpolation: str, resize: int = 256, crop: int = 224, max_size: int | None = None,
                mean: tuple[float, float, float] = (0.485, 0.456, 0.406)) -> ModelDescription:
    pre: dict[str, object] = {"interpolation": interpolation, "resize": resize, "crop": crop, "mean": list(mean)}
    if max_size:
        pre["max_size"] = max_size
    return parse({"name": "m", "model": {"torchvision": "resnet18"}, "preprocess": pre}, Path("/repo/m/model.toml"))


def step_tensor(params: dict[str, str], pixels: np.ndarray) -> np.ndarray:
    import torch

    out = decode.Transform(params, torch.device("cpu"))(torch.from_numpy(pixels))
    assert tuple(out.shape)[:2] == (1, 3)
    return np.asarray(out[0].numpy())


def test_the_steps_resize_geometry_is_the_shims() -> None:
    for width in (1, 2, 3, 10, 99, 224, 225, 640, 4000):
        for height in (1, 7, 224, 233, 480, 3000):
            for size, max_size in ((256, None), (232, None), (224, 300), (160, 180)):
                assert decode.resized_size(width, height, size, max_size) == resized_size(width, height, size, max_size)


@pytest.mark.parametrize("interpolation", ENCODED_INTERPOLATIONS)
@pytest.mark.parametrize(("resize", "crop", "max_size"), GEOMETRIES)
def test_the_decode_step_gives_the_legacy_tensor(interpolation: str, resize: int, crop: int,
                                                 max_size: int | None) -> None:
    d = description(interpolation, resize, crop, max_size, mean=(0.5, 0.45, 0.4))
    spec = ImageSpec.of(d)
    level = 1 / 255 / np.asarray(spec.std, dtype=np.float32)[:, None, None]
    worst = 0.0
    for width, height in SIZES:
        pixels = photo(width, height, seed=width + height)
        got = step_tensor(d.decode_parameters(), pixels)
        want = to_tensor(Image.fromarray(pixels), spec)
        assert got.shape == want.shape == (3, crop, crop), (width, height)
        worst = max(worst, float((np.abs(got - want) / level).max()))
    assert worst <= LEVELS[interpolation] + 1e-3, (interpolation, worst)


def test_the_padding_of_a_small_image_is_zero_pixels_as_centercrop_pads() -> None:
    d = description("bilinear", 160, 200, 180)
    spec = ImageSpec.of(d)
    pixels = photo(640, 480, seed=3)  # resizes to 180 x 135: padded to 200 x 200
    got, want = step_tensor(d.decode_parameters(), pixels), to_tensor(Image.fromarray(pixels), spec)
    np.testing.assert_array_equal(got[:, :32, :], want[:, :32, :])  # the top band is padding alone
    assert np.allclose(got[:, :32, :], spec.table[:, :1][:, :, None])  # pixel 0, normalised


def test_the_step_refuses_what_it_cannot_do_with_the_parameter_named() -> None:
    import torch

    params = description("bilinear").decode_parameters()
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"lacks the parameters color"):
        decode.Transform({k: v for k, v in params.items() if k != "color"}, cpu)
    with pytest.raises(ValueError, match=r"interpolation 'lanczos' is not one this step resizes with"):
        decode.Transform({**params, "interpolation": "lanczos"}, cpu)
    with pytest.raises(ValueError, match=r"color 'gray' is not one of convert, white"):
        decode.Transform({**params, "color": "gray"}, cpu)
    with pytest.raises(ValueError, match=r"parameter mean must be three comma-separated numbers"):
        decode.Transform({**params, "mean": "0.5,0.5"}, cpu)
    with pytest.raises(ValueError, match="too elongated"):
        decode.Transform(description("bilinear", 160, 150, 180).decode_parameters(), cpu)(
            torch.zeros((1, 4000, 3), dtype=torch.uint8))


def test_the_steps_interpolations_are_the_descriptions_encoded_ones() -> None:
    assert decode.RESIZERS == ENCODED_INTERPOLATIONS
    assert set(INTERPOLATIONS) - set(ENCODED_INTERPOLATIONS) == {"box", "hamming", "lanczos"}
    assert set(decode.REQUIRED) | set(decode.OPTIONAL) == set(DECODE_PARAMETERS)
    assert set(decode.REQUIRED) | {"max_size"} == set(description("bilinear", max_size=300).decode_parameters())


@pytest.mark.parametrize("interpolation", ["box", "hamming", "lanczos"])
def test_a_filter_the_step_cannot_reproduce_gets_no_encoded_models_and_says_why(interpolation: str) -> None:
    d = description(interpolation)
    refusal = d.encoded_refusal()
    assert refusal is not None
    assert f"interpolation = '{interpolation}' is one that Triton's decode step cannot reproduce" in refusal
    assert "SHIM_TRANSPORT=encoded cannot serve m: use SHIM_TRANSPORT=fp32 or uint8" in refusal
    files = model_repo.generated_files(d)
    assert not any(rel.parts[0] in ("m_decode", "m_encoded") for rel in files)
    assert {rel.parts[0] for rel in files} == {"m", "normalize", "m_uint8"}


def form(name: str) -> ModelDescription:
    from app.description import load
    from tests.support import ROOT

    return load(ROOT / "examples" / "models" / name / "model.toml")


def test_v2s_tensor_resize_form_is_the_legacy_v2_transform_bit_for_bit() -> None:
    """resize_on = "tensor": the step runs v2's own resize on the uint8 tensor and ToDtype's multiplication,
    so its tensor is the legacy app's exactly (on a CPU instance)."""
    import torch

    from examples.transforms import v2_app

    d = form("v2_app")
    for width, height in SIZES:
        pixels = photo(width, height, seed=width + height)
        got = step_tensor(d.decode_parameters(), pixels)
        want = v2_app(Image.fromarray(pixels))
        assert isinstance(want, torch.Tensor)
        np.testing.assert_array_equal(got, want.numpy(), err_msg=str((width, height)))


@pytest.mark.parametrize("name", ["squash_app", "wide_app"])
def test_fixed_size_and_non_square_forms_give_the_legacy_tensors_shape_within_the_steps_levels(name: str) -> None:
    d = form(name)
    spec = ImageSpec.of(d)
    level = 1 / 255 / np.asarray(spec.std, dtype=np.float32)[:, None, None]
    for width, height in SIZES:
        pixels = photo(width, height, seed=width + height)
        got = step_tensor(d.decode_parameters(), pixels)
        want = to_tensor(Image.fromarray(pixels), spec)
        assert got.shape == want.shape == d.input_shape, (width, height)
        assert float((np.abs(got - want) / level).max()) <= LEVELS["bilinear"] + 1e-3, (width, height)


def test_the_forms_generate_configs_with_their_input_dims_and_parameters() -> None:
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    def configs(name: str) -> dict[str, mc.ModelConfig]:
        files = model_repo.generated_files(form(name))
        return {rel.parts[0]: text_format.Parse(text, mc.ModelConfig()) for rel, text in files.items()
                if rel.name == "config.pbtxt"}

    def parameters(config: mc.ModelConfig) -> dict[str, str]:
        return {key: value.string_value for key, value in config.parameters.items()}

    wide = configs("wide_app")
    assert list(wide["wide_app"].input[0].dims) == [3, 224, 288]
    assert list(wide["wide_app_uint8"].input[0].dims) == [224, 288, 3]
    assert parameters(wide["wide_app_decode"])["crop"] == "224,288"
    assert parameters(wide["wide_app"])["resize"] == "256,320"
    v2 = configs("v2_app")
    assert {k: parameters(v2["v2_app_decode"])[k] for k in ("resize_on", "to_float")} == {
        "resize_on": "tensor", "to_float": "multiply"}
    normalize = model_repo.generated_files(form("v2_app"))[Path("v2_app_normalize/config.pbtxt")]
    assert "multiplication by 1/255" in normalize
    classic = parameters(configs("mobilenet_v3_small")["mobilenet_v3_small"])
    assert not {"antialias", "resize_on", "to_float"} & set(classic)
