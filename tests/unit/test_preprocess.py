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
