"""Does the shim preprocess exactly as your legacy app did? Your app's transform and a folder of your images, both
ways, per image: PASS only when every tensor is bit-exact (or within tolerance where v2 resizes the uint8 tensor).

    python modelrepo/check.py legacy_app:transform ./images                   # resnet50's description
    python modelrepo/check.py my_app:preprocess ./images --model mymodel      # triton_repo/mymodel/model.toml
    python modelrepo/check.py examples.transforms:efficientnet_lite0 ./images \\
        --description examples/models/efficientnet_lite0/model.toml

A step the shim does not reproduce is named; advice is printed only when a rerun with it passes (docs/own-model.md).
Exit status: 0 PASS, 1 FAIL, 2 it could not run.
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import sys
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from app.description import COLORS, DescriptionError, ModelDescription, description_path, load, pair, parse
from app.errors import ShimError
from app.preprocess import ImageSpec, decode, to_tensor

ROOT = Path(__file__).resolve().parent.parent

PASS, FAIL, USAGE = 0, 1, 2
SUPPORTED = ("Compose (v1 or v2, nested), torchvision's ImageClassification weight presets, Resize (int or (h, w)), "
             "CenterCrop, ToTensor, PILToTensor / ToImage + ConvertImageDtype / ToDtype(float32, scale=True), "
             "ToPureTensor and Normalize")


@dataclass
class Implied:
    """What a transform does, in the description's terms; None where it has no such step."""

    resize: int | tuple[int, int] | None = None
    interpolation: str | None = None
    max_size: int | None = None
    antialias: bool | None = None
    resize_on: str | None = None
    crop: int | tuple[int, int] | None = None
    to_float: str | None = None
    mean: tuple[float, ...] = (0.0, 0.0, 0.0)  # no Normalize: (x - 0) / 1 is x, exactly
    std: tuple[float, ...] = (1.0, 1.0, 1.0)
    problems: list[str] = field(default_factory=list)  # steps the shim does not reproduce, each named


@dataclass(frozen=True)
class Step:
    """One step of a transform: kind is resize, crop, to_tensor (PIL -> float), to_uint8 (PIL -> uint8 tensor),
    to_float (uint8 -> float), normalize, noop, or opaque (what the shim does not reproduce: `why` says which)."""

    where: str
    kind: str
    values: dict[str, Any] = field(default_factory=dict)
    why: str = ""


def _name(step: Any) -> str:
    cls = type(step)
    module = cls.__module__
    if module.startswith("torchvision.transforms.v2"):
        return f"transforms.v2.{cls.__name__}"
    if module.startswith("torchvision.transforms"):
        return f"transforms.{cls.__name__}"
    return f"{module}.{cls.__qualname__}"


def _mode(mode: Any) -> str:
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.functional import _interpolation_modes_from_int

    mode = _interpolation_modes_from_int(mode) if isinstance(mode, int) else mode
    return mode.value if isinstance(mode, InterpolationMode) else str(mode)


def _size(size: Any) -> int | tuple[int, int]:
    if isinstance(size, int):
        return size
    values = [int(v) for v in size]
    return values[0] if len(values) == 1 else (values[0], values[1])


def _is_float(dtype: Any) -> bool:
    import torch

    if isinstance(dtype, dict):  # v2's ToDtype({tv_tensors.Image: torch.float32, "others": None})
        from torchvision import tv_tensors

        dtype = dtype.get(tv_tensors.Image, dtype.get("others"))
    return dtype == torch.float32


def steps(transform: Any, prefix: str = "") -> list[Step]:
    """`transform` flattened into Steps: Composes opened, a weight preset expanded into what its forward does."""
    import torch
    from torchvision import transforms as v1
    from torchvision.transforms import _presets, v2

    if isinstance(transform, (v1.Compose, v2.Compose)):
        out: list[Step] = []
        for index, inner in enumerate(transform.transforms, start=1):
            out += steps(inner, f"{prefix}{index}." if prefix or len(transform.transforms) else "")
        return out
    where = f"step {prefix.rstrip('.') or '1'}, {_name(transform)}"
    t = transform
    if isinstance(t, _presets.ImageClassification):
        return [Step(f"{where} (its resize)", "resize", {"resize": _size(t.resize_size), "max_size": None,
                                                         "interpolation": _mode(t.interpolation),
                                                         "antialias": t.antialias is not False}),
                Step(f"{where} (its crop)", "crop", {"crop": _size(t.crop_size)}),
                Step(f"{where} (pil_to_tensor)", "to_uint8"),
                Step(f"{where} (convert_image_dtype)", "to_float", {"to_float": "divide"}),
                Step(f"{where} (normalize)", "normalize", {"mean": tuple(t.mean), "std": tuple(t.std)})]
    if isinstance(t, (v1.Resize, v2.Resize)):
        return [Step(where, "resize", {"resize": _size(t.size), "interpolation": _mode(t.interpolation),
                                       "max_size": t.max_size, "antialias": t.antialias is not False})]
    if isinstance(t, (v1.CenterCrop, v2.CenterCrop)):
        height, width = _size(t.size) if isinstance(_size(t.size), tuple) else (t.size, t.size)
        return [Step(where, "crop", {"crop": height if height == width else (height, width)})]
    if isinstance(t, (v1.ToTensor, v2.ToTensor)):
        return [Step(where, "to_tensor", {"to_float": "divide"})]
    if isinstance(t, (v1.PILToTensor, v2.PILToTensor, v2.ToImage)):
        return [Step(where, "to_uint8")]
    if isinstance(t, v1.ConvertImageDtype) and t.dtype == torch.float32:
        return [Step(where, "to_float", {"to_float": "divide"})]  # F.convert_image_dtype: x / 255
    if isinstance(t, v2.ConvertImageDtype) and t.dtype == torch.float32:
        return [Step(where, "to_float", {"to_float": "multiply"})]  # F.to_dtype(scale=True): x * (1 / 255)
    if isinstance(t, v2.ToDtype) and _is_float(t.dtype):
        if not t.scale:
            return [Step(where, "opaque", why="ToDtype without scale=True keeps the values 0..255; the shim's "
                                              "tensor is scaled to [0, 1] (add scale=True, or keep this app)")]
        return [Step(where, "to_float", {"to_float": "multiply"})]
    if isinstance(t, v2.ToPureTensor):
        return [Step(where, "noop")]
    if isinstance(t, (v1.Normalize, v2.Normalize)):
        return [Step(where, "normalize", {"mean": tuple(float(v) for v in t.mean),
                                          "std": tuple(float(v) for v in t.std)})]
    if isinstance(t, (v1.Lambda, v2.Lambda)):
        function = getattr(t.lambd, "__name__", type(t.lambd).__name__)
        return [Step(f"{where}({function})", "opaque", why="a function the shim cannot see into")]
    kind = type(t).__name__
    if type(t).__module__.startswith("torchvision.transforms"):
        why = "the shim does not reproduce it" + (" (random: an augmentation, which a serving transform should not "
                                                  "have)" if kind.startswith(("Random", "ColorJitter")) else "")
        return [Step(where, "opaque", why=why)]
    if isinstance(t, torch.nn.Module):
        return [Step(where, "opaque", why=f"a module ({type(t).__qualname__}) the shim cannot see into")]
    what = getattr(t, "__name__", type(t).__qualname__)
    return [Step(f"step {prefix.rstrip('.') or '1'}, {getattr(t, '__module__', '?')}.{what}", "opaque",
                 why="a function the shim cannot see into")]


def read_transform(transform: Any) -> Implied:
    """Each step mapped to the description's fields, or named as a problem; where the image is (PIL, uint8 or
    float tensor) decides what a Resize means (resize_on) and what may follow."""
    implied = Implied()
    stage, seen = "pil", []
    for step in steps(transform):
        v = step.values
        if step.kind == "opaque":
            implied.problems.append(f"{step.where}: {step.why}")
            continue
        if step.kind in seen and step.kind in ("resize", "crop", "normalize"):
            implied.problems.append(f"{step.where}: a second {step.kind}; the shim runs each step once")
            continue
        if step.kind == "resize":
            if "crop" in seen:
                implied.problems.append(f"{step.where}: after CenterCrop; the shim resizes, then crops")
            if stage == "float":
                implied.problems.append(f"{step.where}: resizes the float tensor (after ToTensor / ToDtype); the "
                                        "shim resizes the image's uint8 pixels: move Resize before the conversion")
            resize_on = "pil" if stage == "pil" else "tensor"
            if resize_on == "tensor" and not v["antialias"]:
                implied.problems.append(f"{step.where}: antialias=False on a tensor: torch's resize without "
                                        "antialiasing is not reproduced; use antialias=True (v2's default) or "
                                        "resize the PIL image")
            if resize_on == "tensor" and v["interpolation"] not in ("bilinear", "bicubic"):
                implied.problems.append(f"{step.where}: {v['interpolation']} on a tensor is not reproduced (on a "
                                        "tensor: bilinear or bicubic); resize the PIL image instead")
            implied.resize, implied.interpolation, implied.max_size = v["resize"], v["interpolation"], v["max_size"]
            # antialias does not apply to PIL images (Pillow always filters): only a tensor resize states it
            implied.antialias, implied.resize_on = (v["antialias"] if resize_on == "tensor" else None), resize_on
        elif step.kind == "crop":
            if "resize" not in seen:
                implied.problems.append(f"{step.where}: before any Resize; the shim resizes, then crops")
            implied.crop = v["crop"]
        elif step.kind in ("to_tensor", "to_uint8"):
            if stage != "pil":
                implied.problems.append(f"{step.where}: the image is a tensor already")
            stage = "float" if step.kind == "to_tensor" else "uint8"
            implied.to_float = v.get("to_float", implied.to_float)
        elif step.kind == "to_float":
            if stage == "pil":
                implied.problems.append(f"{step.where}: on a PIL image it does nothing; put ToImage (or "
                                        "PILToTensor) before it")
            elif stage == "uint8":
                stage, implied.to_float = "float", v["to_float"]
        elif step.kind == "normalize":
            if stage != "float":
                implied.problems.append(f"{step.where}: before the image is a float tensor")
            implied.mean, implied.std = v["mean"], v["std"]
            if len(implied.mean) != 3 or len(implied.std) != 3:
                implied.problems.append(f"{step.where}: mean/std of {len(implied.mean)} values; the shim takes one "
                                        "per channel (3)")
        seen.append(step.kind)
    if "resize" not in seen:
        implied.problems.append("no Resize step: the shim resizes every image first (Resize(int) or Resize((h, w)))")
    if "crop" not in seen:
        if isinstance(implied.resize, tuple):
            implied.crop = implied.resize  # Resize((h, w)) alone: the model input is (h, w)
        elif "resize" in seen:
            implied.problems.append("no CenterCrop after Resize(int): the tensor's size would follow each image's "
                                    "aspect ratio, and Triton's input has fixed dims; add CenterCrop, or resize "
                                    "to a fixed (height, width)")
    if any(step.kind == "opaque" for step in steps(transform)):
        implied.problems.append(f"the shim reproduces {SUPPORTED}")
    if stage != "float":
        implied.problems.append("the transform does not end in a float tensor (ToTensor, or ToImage + "
                                "ToDtype(torch.float32, scale=True))")
    return implied


def differences(implied: Implied, description: ModelDescription) -> dict[str, Any]:
    """The description's fields whose values differ from the transform's: {field: the transform's value}."""
    out: dict[str, Any] = {}
    for key in (f.name for f in fields(Implied) if f.name != "problems"):
        value, ours = getattr(implied, key), getattr(description, key)
        if key == "max_size":
            value = value or None
        if value is None and key != "max_size":
            continue
        if value == ours or (key == "crop" and pair(value) == pair(ours)):  # CenterCrop(224) is (224, 224)
            continue
        out[key] = value
    return out


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if value is None:
        return "0"
    if isinstance(value, tuple):
        return "[" + ", ".join(repr(v) for v in value) + "]"
    return repr(value)


@dataclass
class Compared:
    name: str
    max_diff: float | None = None  # None: not compared (see note)
    note: str = ""


@dataclass
class Result:
    implied: Implied
    differences: dict[str, Any]
    images: list[Compared]
    tolerance: float = 0.0
    description: str = "the description"
    advice: list[str] = field(default_factory=list)  # field settings verified to make the check pass
    no_advice: str = ""  # why there is none, when it fails

    @property
    def compared(self) -> list[Compared]:
        return [c for c in self.images if c.max_diff is not None]

    @property
    def worst(self) -> float:
        return max((c.max_diff or 0.0 for c in self.compared), default=0.0)

    @property
    def passed(self) -> bool:
        return (not self.implied.problems and not self.differences and bool(self.compared)
                and len(self.compared) == len(self.images) and self.worst <= self.tolerance)

    def lines(self) -> list[str]:
        out = []
        for c in self.images:
            if c.max_diff is None:
                out.append(f"  {c.name}: not compared ({c.note})")
            else:
                verdict = ("bit-exact" if c.max_diff == 0 else "within tolerance" if c.max_diff <= self.tolerance
                           else "DIFFERS")
                out.append(f"  {c.name}: max |legacy - shim| = {c.max_diff:.3g} ({verdict}){c.note}")
        if self.passed:
            if self.worst == 0:
                out.append(f"PASS: {len(self.compared)} images, every tensor bit-exact (max difference 0)")
            else:
                out.append(f"PASS: {len(self.compared)} images, max difference {self.worst:.3g} <= the tolerance "
                           f"{self.tolerance:.3g} (one pixel level: v2 resizes the tensor with torch, the shim with "
                           "Pillow)")
            return out
        out.append("FAIL:")
        out += [f"  - {problem}" for problem in self.implied.problems]
        out += [f"  - {key}: the legacy transform has {_toml(value)}, {self.description} has a different value"
                for key, value in self.differences.items()]
        differing = [c for c in self.compared if (c.max_diff or 0.0) > self.tolerance]
        if differing:
            worst = max(differing, key=lambda c: c.max_diff or 0.0)
            out.append(f"  - {len(differing)} of {len(self.compared)} images differ (the largest: {worst.name}, "
                       f"{worst.max_diff:.3g})")
        refused = [c for c in self.images if c.max_diff is None]
        if refused:
            out.append(f"  - {len(refused)} image(s) not compared")
        if not self.compared:
            out.append("  - no image could be compared")
        if self.advice:
            out.append("advice (verified: the check was run again with it and passes on these images):")
            out += [f"  set [preprocess] {line}" for line in self.advice]
        else:
            out.append(f"no advice: {self.no_advice}")
        return out


def compare(transform: Callable[[Any], Any], description: ModelDescription,
            images: list[tuple[str, bytes]]) -> list[Compared]:
    """Every image both ways: the legacy tensor against the shim's, through `description`."""
    from PIL import Image

    spec = ImageSpec.of(description)
    compared = []
    for name, data in images:
        try:
            ours = to_tensor(decode(data, spec), spec)
        except ShimError as e:
            compared.append(Compared(name, note=f"the shim refuses it: {e.code}: {e.message}"))
            continue
        opened = Image.open(io.BytesIO(data))
        try:
            out = transform(opened.convert("RGB") if description.color == "convert" else _shim_rgb(opened, spec))
        except Exception as e:  # the team's transform: whatever it raises on this image, say so for the image
            compared.append(Compared(name, note=f"the legacy transform raised {type(e).__name__}: {e}"))
            continue
        theirs = np.asarray(out.detach().cpu().numpy() if hasattr(out, "detach") else out)
        if theirs.shape != ours.shape:
            compared.append(Compared(name, note=f"the legacy tensor is {list(theirs.shape)}, the shim's "
                                                f"{list(ours.shape)}"))
            continue
        diff = float(np.abs(theirs.astype(np.float64) - ours.astype(np.float64)).max())
        compared.append(Compared(name, diff, "" if theirs.dtype == np.float32 else f"; legacy dtype {theirs.dtype}"))
    return compared


def _with(description: ModelDescription, changes: dict[str, Any]) -> ModelDescription | str:
    """The description with `changes` in its [preprocess], read back through parse(); or why parse refuses it."""
    raw = tomllib.loads(description.path.read_text()) if description.path.is_file() else {"name": description.name}
    pre = dict(raw.get("preprocess", {}))
    for key, value in changes.items():
        pre[key] = (0 if value is None else list(value) if isinstance(value, tuple) else value)
    try:
        return parse({**raw, "preprocess": pre}, description.path)
    except DescriptionError as e:
        return str(e)


def check(transform: Callable[[Any], Any], description: ModelDescription,
          images: Iterable[tuple[str, bytes]]) -> Result:
    """The transform read step by step, then every image both ways; advice only where a rerun with it passes."""
    images = list(images)
    implied = read_transform(transform)
    diffs = differences(implied, description)
    result = Result(implied, diffs, compare(transform, description, images),
                    tolerance=description.tolerance, description=str(description.path))
    if result.passed:
        return result
    if implied.problems:
        result.no_advice = ("the transform has steps the shim does not reproduce (above); no [preprocess] value "
                            "makes it pass")
        return result
    candidates = [diffs] if diffs else []
    if not diffs:  # the steps agree: the one field left is how a non-RGB image becomes RGB
        candidates = [{"color": other} for other in COLORS if other != description.color]
    for changes in candidates:
        candidate = _with(description, changes)
        if isinstance(candidate, str):
            result.no_advice = f"the transform's values are not a valid description: {candidate}"
            continue
        rerun = compare(transform, candidate, images)
        if all(c.max_diff is not None and c.max_diff <= candidate.tolerance for c in rerun):
            result.advice = [f"{key} = {_toml(value)}" for key, value in changes.items()]
            return result
    result.no_advice = result.no_advice or ("no value of the description's fields was found that makes every "
                                            "image agree (tried: " + "; ".join(
                                                ", ".join(f"{k} = {_toml(v)}" for k, v in c.items())
                                                for c in candidates) + ")")
    return result


def _shim_rgb(image: Any, spec: Any) -> Any:
    from app.preprocess import to_rgb

    image.load()
    return to_rgb(image, spec)


def import_transform(target: str) -> Any:
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise SystemExit(f"check_preprocess: {target!r} is not MODULE:ATTRIBUTE (e.g. legacy_app:transform)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        value: Any = importlib.import_module(module_name)
    except Exception as e:  # the team's module: whatever it raises while importing, say so in one line
        raise SystemExit(f"check_preprocess: importing {module_name} failed: {type(e).__name__}: {e}") from None
    for part in attribute.split("."):
        if not hasattr(value, part):
            raise SystemExit(f"check_preprocess: {module_name} has no attribute {attribute!r}")
        value = getattr(value, part)
    if not callable(value):
        raise SystemExit(f"check_preprocess: {target} is a {type(value).__name__}, not a transform")
    return value


def image_files(folder: Path) -> Iterable[tuple[str, bytes]]:
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        yield path.relative_to(folder).as_posix(), path.read_bytes()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("transform", help="MODULE:ATTRIBUTE of the legacy app's transform, e.g. legacy_app:transform")
    p.add_argument("images", type=Path, help="a folder of your images (searched recursively)")
    p.add_argument("--description", type=Path, help="the model's model.toml (default: <repository>/<model>/model.toml)")
    p.add_argument("--repository", type=Path,
                   default=Path(os.environ.get("SHIM_MODEL_REPOSITORY", ROOT / "triton_repo")))
    p.add_argument("--model", default=os.environ.get("SHIM_MODEL_NAME", "resnet50"))
    args = p.parse_args(argv)
    try:
        description = load(args.description or description_path(args.repository, args.model))
    except DescriptionError as e:
        print(f"check_preprocess: {e}", file=sys.stderr)
        return USAGE
    if not args.images.is_dir():
        print(f"check_preprocess: {args.images} is not a folder", file=sys.stderr)
        return USAGE
    try:
        transform = import_transform(args.transform)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return USAGE
    print(f"check_preprocess: {args.transform} against {description.path} ({description})")
    result = check(transform, description, image_files(args.images))
    for line in result.lines():
        print(line)
    return PASS if result.passed else FAIL


if __name__ == "__main__":
    sys.exit(main())
