"""Export a torchvision ResNet to TorchScript for Triton's libtorch backend.

Writes `<repo>/<model>/<version>/model.pt` and `<repo>/<model>/labels.txt` (ImageNet class names
from torchvision's weight metadata; nothing is downloaded).

Weights: a local state_dict file given with --weights or $SHIM_MODEL_WEIGHTS is loaded strictly.
Without one, a fixed seed initialises the network: the architecture (and so speed and shapes) is
real, the predictions are not. The tool says which in one line, and records it inside model.pt.

    python tools/export_model.py                         # resnet50, seeded, into triton_repo/resnet50/1
    python tools/export_model.py --arch resnet18 --repo /tmp/repo
    python tools/export_model.py --weights ~/resnet50-11ad3fa6.pth
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import warnings
import zipfile
from pathlib import Path

ARCHS = {
    "resnet18": "ResNet18_Weights",
    "resnet34": "ResNet34_Weights",
    "resnet50": "ResNet50_Weights",
    "resnet101": "ResNet101_Weights",
}
DEFAULT_SEED = 0
# Read back by tools and tests with torch.jit.load(..., _extra_files={EXPORT_INFO: ""}).
EXPORT_INFO = "export.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    root = Path(__file__).resolve().parent.parent
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=sorted(ARCHS), default=os.environ.get("SHIM_MODEL_ARCH", "resnet50"))
    p.add_argument("--weights", type=Path, default=os.environ.get("SHIM_MODEL_WEIGHTS") or None,
                   help="local state_dict (.pth); default: $SHIM_MODEL_WEIGHTS, else a fixed seed")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--repo", type=Path, default=root / "triton_repo", help="Triton model repository")
    p.add_argument("--model-name", default="resnet50", help="model folder in the repository")
    p.add_argument("--version", type=int, default=1)
    p.add_argument("--force", action="store_true", help="overwrite an existing model.pt")
    return p.parse_args(argv)


# TorchScript is what Triton's libtorch backend loads, whatever torch thinks of its future.
warnings.filterwarnings("ignore", message=r".*torch\.jit.* is deprecated", category=FutureWarning)


def build_model(arch: str, weights: Path | None, seed: int):  # -> torch.nn.Module
    import torch
    import torchvision

    torch.manual_seed(seed)
    model = getattr(torchvision.models, arch)(weights=None)
    if weights is not None:
        if not weights.is_file():
            raise SystemExit(f"export_model: weights file {weights} does not exist")
        state = torch.load(weights, map_location="cpu", weights_only=True)
        model.load_state_dict(state.get("state_dict", state), strict=True)
    return model.eval()


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
NORMALIZE_INFO = {"model": "normalize", "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD), "layout": "NHWC uint8"}


def build_normalize():  # -> torch.nn.Module
    """UINT8 [N, H, W, 3] -> FP32 [N, 3, H, W]: torchvision's ToTensor + Normalize, the same float32 ops in order.

    Every divisor is a tensor: CUDA turns a division by a scalar into a multiplication by its reciprocal,
    which can differ in the last bit from what the legacy app computed on the CPU.
    """
    import torch

    class Normalize(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.full((1, 1, 1, 1), 255.0, dtype=torch.float32))
            self.register_buffer("mean", torch.tensor(IMAGENET_MEAN, dtype=torch.float32).view(1, 3, 1, 1))
            self.register_buffer("std", torch.tensor(IMAGENET_STD, dtype=torch.float32).view(1, 3, 1, 1))

        def forward(self, pixels: torch.Tensor) -> torch.Tensor:
            chw = pixels.permute(0, 3, 1, 2).to(torch.float32).div(self.scale)  # ToTensor
            return chw.sub(self.mean).div(self.std).contiguous()  # Normalize: sub, then div

    return Normalize().eval()


def export_normalize(repo: Path, version: int = 1, force: bool = False) -> Path | None:
    """Write <repo>/normalize/<version>/model.pt when the repository has that model and the file is not current."""
    if not (repo / "normalize" / "config.pbtxt").is_file():
        return None
    target = repo / "normalize" / str(version) / "model.pt"
    existing = read_export_info(target) or {}
    if not force and all(existing.get(k) == v for k, v in NORMALIZE_INFO.items()):
        return target
    save_torchscript(build_normalize(), target, NORMALIZE_INFO)
    print(f"export_model: wrote {target} (ToTensor + Normalize for the uint8 transport)")
    return target


def labels_for(arch: str) -> list[str]:
    import torchvision

    weights_enum = getattr(torchvision.models, ARCHS[arch])
    categories: list[str] = weights_enum.DEFAULT.meta["categories"]
    return categories


def save_torchscript(model, target: Path, info: dict[str, object]) -> None:
    """Script `model` and write it atomically, with `info` (plus the torch version) inside the file."""
    import torch

    scripted = torch.jit.script(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".pt.tmp")
    torch.jit.save(scripted, str(tmp), _extra_files={EXPORT_INFO: json.dumps({**info, "torch": torch.__version__})})
    tmp.replace(target)  # a half-written model.pt must never be seen by a polling Triton


def read_export_info(path: Path) -> dict[str, object] | None:
    """The info that save_torchscript stored in a model.pt (a zip archive), or None."""
    try:
        with zipfile.ZipFile(path) as archive:
            name = next((n for n in archive.namelist() if n.endswith(f"/extra/{EXPORT_INFO}")), None)
            return json.loads(archive.read(name)) if name else None
    except (OSError, zipfile.BadZipFile, ValueError):
        return None


def write_labels(arch: str, path: Path) -> list[str]:
    labels = labels_for(arch)
    path.write_text("\n".join(labels) + "\n")
    return labels


def export(args: argparse.Namespace) -> Path:
    model_dir = args.repo / args.model_name
    if not (model_dir / "config.pbtxt").is_file():
        raise SystemExit(f"export_model: {model_dir}/config.pbtxt not found; is --repo a Triton model repository?")
    target = model_dir / str(args.version) / "model.pt"
    labels_path = model_dir / "labels.txt"

    labels = write_labels(args.arch, labels_path)
    if args.weights is not None:
        digest = hashlib.sha256(args.weights.read_bytes()).hexdigest()[:16]
        source: dict[str, object] = {"weights": str(args.weights), "sha256": digest}
    else:
        source = {"seed": args.seed}
    info = {"arch": args.arch, "num_classes": len(labels), **source}
    if target.exists() and not args.force:
        existing = read_export_info(target) or {}
        if all(existing.get(k) == v for k, v in info.items()):
            print(f"export_model: {target} is already {args.arch} ({source}), kept (--force re-exports)")
            return target
        print(f"export_model: {target} holds {existing or 'an unknown model'}; re-exporting as {args.arch}")

    model = build_model(args.arch, args.weights, args.seed)
    if args.weights is not None:
        print(f"export_model: {args.arch} with pretrained weights from {args.weights} (sha256 {digest}...)")
    else:
        print(f"export_model: {args.arch} with RANDOM weights (seed {args.seed}): right shapes and speed, "
              "meaningless predictions; pass --weights or set SHIM_MODEL_WEIGHTS for real ones")

    save_torchscript(model, target, info)
    print(f"export_model: wrote {target} and {labels_path}")
    return target


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    export(args)
    export_normalize(args.repo, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
