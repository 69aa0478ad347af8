"""The shim's Pillow+numpy preprocessing against the legacy app's torchvision transforms."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from app.errors import EmptyImage, InvalidImage, TooLarge
from app.preprocess import ImageSpec, decode, to_tensor
from tests.support import encode, photo, reference_transform
from tests.uploads import png_header_only, valid_uploads

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
    import io

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
