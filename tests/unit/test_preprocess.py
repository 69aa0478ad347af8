"""The shim's Pillow+numpy preprocessing against the legacy app's torchvision transforms."""

from __future__ import annotations

import io
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from app.errors import EmptyImage, InvalidImage, TooLarge
from app.preprocess import ImageSpec, decode, to_tensor
from tests.support import encode, mutated, photo, reference_transform
from tests.uploads import malformed_uploads, png_header_only, valid_uploads

SPEC = ImageSpec()


@pytest.mark.parametrize("size", [(640, 480), (480, 640), (256, 256), (224, 224), (257, 300), (1, 1), (3, 700),
                                  (1999, 1001), (225, 10)])
def test_same_tensor_as_torchvision(size: tuple[int, int]) -> None:
    image = Image.fromarray(photo(*size, seed=sum(size)))
    ours = to_tensor(image, SPEC)
    assert ours.shape == (3, 224, 224) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, reference_transform()(image), rtol=0, atol=1e-6)


@pytest.mark.parametrize("upload", valid_uploads(), ids=lambda u: u.name)
def test_same_tensor_for_every_image_kind_the_contract_accepts(upload: object) -> None:
    data = upload.files["image"][1]  # type: ignore[attr-defined]
    ours = to_tensor(decode(data, SPEC), SPEC)
    theirs = reference_transform()(Image.open(io.BytesIO(data)).convert("RGB"))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6)


@pytest.mark.prod
def test_decode_refuses_with_the_contracts_errors() -> None:
    with pytest.raises(EmptyImage):
        decode(b"", SPEC)
    with pytest.raises(InvalidImage):
        decode(b"GIF89a nonsense", SPEC)
    with pytest.raises(TooLarge, match="too large"):  # Pillow's own guard, before ours
        decode(png_header_only(30_000, 30_000), SPEC)
    with pytest.raises(TooLarge, match=r"image is 8000x5001 pixels; the limit is 40,000,000 pixels"):
        decode(png_header_only(8000, 5001), SPEC)
    with pytest.raises(TooLarge, match="elongated"):
        to_tensor(Image.new("RGB", (200_000, 1)), ImageSpec())
    small = ImageSpec(max_pixels=1000)
    with pytest.raises(TooLarge):
        decode(encode(photo(100, 100), "PNG"), small)


def test_an_eps_upload_is_refused_without_running_ghostscript(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Pillow reads EPS by running Ghostscript on it. A stand-in `gs` that leaves a mark shows it never runs: the
    upload is refused as a format this service does not read, by decode() and by the encoded route's sniff."""
    from PIL import EpsImagePlugin

    from app.sniff import cpu_reason

    mark = tmp_path / "ghostscript-ran"
    gs = tmp_path / "gs"
    gs.write_text(f"#!/bin/sh\ntouch {mark}\nexit 1\n")
    gs.chmod(0o755)
    monkeypatch.setattr(EpsImagePlugin, "gs_binary", str(gs))
    eps = encode(photo(64, 48), "EPS")
    # What Image.open alone does with it (Pillow raises what the failed `gs` run raised: no 4xx the API knows)
    with pytest.raises(subprocess.CalledProcessError), Image.open(io.BytesIO(eps)) as image:
        assert image.format == "EPS"
        image.load()
    assert mark.exists(), "the stand-in for Ghostscript did not run: this test would prove nothing"
    mark.unlink()

    with pytest.raises(InvalidImage, match="not an image format this service reads"):
        decode(eps, SPEC)
    assert cpu_reason(eps, SPEC) == "unreadable"
    assert not mark.exists()

    # The DOS EPS binary header in front of the same PostScript: EPS to Pillow too
    dos = b"\xc5\xd0\xd3\xc6" + (30).to_bytes(4, "little") + len(eps).to_bytes(4, "little") + bytes(16) + b"\xff\xff"
    with Image.open(io.BytesIO(dos + eps)) as image:
        assert image.format == "EPS"
    with pytest.raises(InvalidImage, match="not an image format this service reads"):
        decode(dos + eps, SPEC)
    assert not mark.exists()


@pytest.mark.parametrize("name", malformed_uploads())
def test_a_malformed_file_that_trips_pillow_is_the_uploads_400(name: str) -> None:
    from app.sniff import cpu_reason

    data, raised = malformed_uploads()[name]
    with pytest.raises(raised), Image.open(io.BytesIO(data)) as image:  # Pillow alone: neither OSError nor ValueError
        image.load()
    with pytest.raises(InvalidImage, match=f"not a readable image \\({raised.__name__}: "):
        decode(data, SPEC)
    assert cpu_reason(data, SPEC) == "unreadable"


@pytest.mark.filterwarnings("ignore")  # as in production: Pillow's warnings are not raised (pytest's are)
def test_fuzzed_uploads_of_every_format_get_only_the_contracts_errors() -> None:
    """Seeded mutations (bytes changed, cut, inserted) of small images in the formats Pillow writes: decode and the
    tensor either succeed or raise the contract's error. This seed found the DDS failure above."""
    import random

    from app.errors import ShimError

    rng = random.Random(1)
    image = Image.fromarray(photo(64, 48, seed=16))
    seeds = [encode(image.convert(mode), fmt) for fmt, mode in [
        ("JPEG", "RGB"), ("PNG", "RGB"), ("GIF", "P"), ("BMP", "RGB"), ("TIFF", "RGB"), ("WEBP", "RGB"),
        ("ICO", "RGB"), ("PPM", "RGB"), ("TGA", "RGB"), ("PCX", "RGB"), ("SGI", "RGB"), ("DDS", "RGB"),
        ("QOI", "RGB"), ("SPIDER", "L"), ("JPEG2000", "RGB"), ("MSP", "1")]]
    escaped = []
    for data in mutated(rng, seeds, 3000, edits=8, cut=64, new_byte=lambda: rng.randrange(256),
                        inserted=lambda: rng.randbytes(rng.randint(1, 16))):
        try:
            to_tensor(decode(data, SPEC), SPEC)
        except ShimError:
            pass
        except Exception as e:  # what the API would have answered with a 500
            escaped.append(f"{type(e).__name__}: {e}")
    assert not escaped, escaped[:5]


INTERPOLATIONS = ["nearest", "nearest-exact", "bilinear", "bicubic", "box", "hamming", "lanczos"]
# (resize, crop, max_size): a model's own; a crop that fills the short side; max_size shrinking the short side
# below the crop, where CenterCrop pads with zeros.
GEOMETRIES = [(232, 224, None), (224, 224, None), (160, 200, 180)]
SIZES = [(640, 480), (480, 640), (1, 1), (225, 10), (232, 232), (300, 233), (701, 333)]


@pytest.mark.parametrize("interpolation", INTERPOLATIONS)
@pytest.mark.parametrize(("resize", "crop", "max_size"), GEOMETRIES)
def test_every_interpolation_and_geometry_is_bit_exact_with_torchvision(interpolation: str, resize: int, crop: int,
                                                                        max_size: int | None) -> None:
    """torchvision 0.29's PIL path: Pillow's filter for the mode (nearest-exact is Pillow's NEAREST too; antialias
    does not apply to PIL images), _compute_resized_output_size's truncation and max_size, round() crop offsets."""
    from torchvision import transforms
    from torchvision.transforms import InterpolationMode

    spec = ImageSpec(resize=resize, crop=crop, interpolation=interpolation, max_size=max_size,
                     mean=(0.5, 0.4, 0.3), std=(0.2, 0.3, 0.25))
    pipeline = transforms.Compose([transforms.Resize(resize, InterpolationMode(interpolation), max_size=max_size,
                                                     antialias=True),
                                   transforms.CenterCrop(crop), transforms.ToTensor(),
                                   transforms.Normalize(spec.mean, spec.std)])
    for size in SIZES:
        if max_size and min(size) * max_size < max(size):
            continue  # the short side would become 0 pixels: torchvision fails, the shim answers 413 (below)
        image = Image.fromarray(photo(*size, seed=sum(size)))
        ours = to_tensor(image, spec)
        assert ours.shape == (3, crop, crop)
        assert np.array_equal(ours, pipeline(image).numpy()), (interpolation, size)  # max abs diff 0


def test_a_strip_that_max_size_would_shrink_to_nothing_is_refused() -> None:
    with pytest.raises(TooLarge, match="too elongated"):
        to_tensor(Image.new("RGB", (3, 700)), ImageSpec(resize=160, crop=150, max_size=180))


def test_white_composites_transparency_on_white_and_convert_drops_it() -> None:
    rgba = Image.new("RGBA", (4, 4), (200, 10, 10, 0))  # fully transparent red
    data = encode(rgba, "PNG")
    assert decode(data, ImageSpec()).getpixel((0, 0)) == (200, 10, 10)  # Pillow's convert: alpha dropped
    assert decode(data, ImageSpec(color="white")).getpixel((0, 0)) == (255, 255, 255)
    gray = encode(Image.new("L", (4, 4), 77), "PNG")
    assert decode(gray, ImageSpec(color="white")).getpixel((0, 0)) == (77, 77, 77)


def test_an_unknown_interpolation_is_refused_when_the_spec_is_built() -> None:
    with pytest.raises(ValueError, match="interpolation 'bicubical'"):
        ImageSpec(interpolation="bicubical")


@pytest.mark.parametrize("to_float", ["divide", "multiply"])
def test_the_table_and_the_uint8_step_are_totensor_or_v2s_todtype_for_every_pixel_value(to_float: str) -> None:
    """divide: ToTensor's x / 255; multiply: v2's ToDtype(float32, scale=True), x * (1 / 255), whose last bit differs
    for some values. The shim's lookup table and the uint8 transport's normalize step (modelrepo/export.py) give
    exactly what the legacy transform gives, for all 256 values."""
    import torch
    from torchvision.transforms import functional as v1
    from torchvision.transforms.v2 import functional as f2

    from modelrepo.export import build_normalize

    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    spec = ImageSpec(mean=mean, std=std, to_float=to_float)
    values = torch.arange(256, dtype=torch.uint8).view(1, 1, 256).expand(3, 1, 256).contiguous()
    floats = values.to(torch.float32).div(255) if to_float == "divide" else f2.to_dtype(values, torch.float32,
                                                                                       scale=True)
    want = v1.normalize(floats, list(mean), list(std))[:, 0, :].numpy()
    np.testing.assert_array_equal(spec.table, want)
    step = build_normalize(mean, std, to_float)(values.permute(1, 2, 0).unsqueeze(0))[0, :, 0, :]
    np.testing.assert_array_equal(step.numpy(), want)
    other = ImageSpec(mean=mean, std=std, to_float="multiply" if to_float == "divide" else "divide")
    assert not np.array_equal(other.table, want)  # the choice matters: some values differ in the last bit


def test_a_fixed_size_resize_and_a_non_square_crop_are_torchvisions() -> None:
    from torchvision import transforms

    for resize, crop_size in (((224, 224), (224, 224)), ((256, 320), (224, 288)), (256, (224, 160))):
        spec = ImageSpec(resize=resize, crop=crop_size)
        legacy = transforms.Compose([transforms.Resize(resize), transforms.CenterCrop(crop_size),
                                     transforms.ToTensor(), transforms.Normalize(spec.mean, spec.std)])
        for width, height in ((640, 480), (200, 500), (1, 1), (320, 256)):
            image = Image.fromarray(photo(width, height, seed=width))
            got = to_tensor(image, spec)
            assert got.shape == spec.shape == (3, *((crop_size,) * 2 if isinstance(crop_size, int) else crop_size))
            np.testing.assert_array_equal(got, legacy(image).numpy(), err_msg=str((resize, crop_size, width, height)))
