"""Does the shim preprocess exactly as your legacy app did? Your app's torchvision transform and a folder of your
images, both ways, compared per image; PASS only when every tensor is bit-exact.

    python modelrepo/check.py legacy_app:transform ./images                   # resnet50's description
    python modelrepo/check.py my_app:preprocess ./images --model mymodel      # triton_repo/mymodel/model.toml
    python modelrepo/check.py examples.transforms:efficientnet_lite0 ./images \\
        --description examples/models/efficientnet_lite0/model.toml

MODULE:ATTRIBUTE is imported as your app imports it (the current folder is on the path; importing an app may
load its model). Each image is opened as the legacy app opened it (Pillow, then convert("RGB")) and run through
the transform, and decoded and preprocessed by the shim with the model's description; the line per image is
the largest absolute difference between the two tensors. Before that, the transform itself is read step by
step: a step the shim does not reproduce (an unknown torchvision class, a Lambda, a random augmentation such
as ColorJitter, transforms v2) is named, never approximated, and a step whose values differ from the
description (size, interpolation, crop, mean, std) is named with the field to change.
Exit status: 0 PASS, 1 FAIL (what differs and why is listed), 2 it could not run (the message says why).
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from app.description import DescriptionError, ModelDescription, description_path, load  # noqa: E402
from app.errors import ShimError  # noqa: E402
from app.preprocess import decode, to_tensor  # noqa: E402

PASS, FAIL, USAGE = 0, 1, 2
SUPPORTED = "Resize(int), CenterCrop, ToTensor and Normalize of torchvision.transforms (v1) on PIL images"


@dataclass
class Implied:
    """What a transform does, in the description's terms; None where it has no such step."""

    resize: int | None = None
    interpolation: str | None = None
    max_size: int | None = None
    crop: int | None = None
    mean: tuple[float, ...] = (0.0, 0.0, 0.0)  # no Normalize: (x - 0) / 1 is x, exactly
    std: tuple[float, ...] = (1.0, 1.0, 1.0)
    problems: list[str] = field(default_factory=list)  # steps the shim does not reproduce, each named


def _steps(transform: Any) -> list[Any]:
    from torchvision import transforms

    if isinstance(transform, transforms.Compose):
        return [step for inner in transform.transforms for step in _steps(inner)]
    return [transform]


def _name(step: Any) -> str:
    cls = type(step)
    module = cls.__module__
    if module.startswith("torchvision.transforms.v2"):
        return f"torchvision.transforms.v2.{cls.__name__}"
    if module.startswith("torchvision.transforms"):
        return f"transforms.{cls.__name__}"
    return f"{module}.{cls.__qualname__}"


def read_transform(transform: Any) -> Implied:
    """Each step of `transform` (a Compose is flattened) mapped to the description's fields, or named as a problem."""
    from torchvision import transforms
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.functional import _interpolation_modes_from_int

    implied = Implied()
    order = ["Resize", "CenterCrop", "ToTensor", "Normalize"]
    seen: list[str] = []
    for index, step in enumerate(_steps(transform), start=1):
        where = f"step {index}, {_name(step)}"
        kind = type(step).__name__ if type(step).__module__.startswith("torchvision.transforms.transforms") else None
        if isinstance(step, transforms.Lambda):
            implied.problems.append(f"{where}({getattr(step.lambd, '__name__', 'a function')}): a function the shim "
                                    "cannot see into; it reproduces only " + SUPPORTED)
            continue
        if kind not in order:
            implied.problems.append(f"{where}: the shim does not reproduce it (it reproduces {SUPPORTED}); "
                                    + ("random: an augmentation, which a serving transform should not have"
                                       if kind and kind.startswith(("Random", "ColorJitter")) else
                                       "transforms v2 rounds differently from v1 on PIL images"
                                       if _name(step).startswith("torchvision.transforms.v2") else
                                       "remove it from the serving transform, or keep this app"))
            continue
        if kind in seen:
            implied.problems.append(f"{where}: a second {kind}; the shim runs each step once")
            continue
        if seen and order.index(kind) < order.index(seen[-1]):
            implied.problems.append(f"{where}: after {seen[-1]}; the shim runs " + " -> ".join(order))
        seen.append(kind)
        if kind == "Resize":
            size = step.size
            if isinstance(size, (list, tuple)) and len(size) == 2:
                implied.problems.append(f"{where}({tuple(size)}): a resize to a fixed (height, width); the shim "
                                        "resizes the short side, Resize(int)")
                continue
            implied.resize = int(size[0] if isinstance(size, (list, tuple)) else size)
            mode = step.interpolation
            mode = _interpolation_modes_from_int(mode) if isinstance(mode, int) else mode
            implied.interpolation = mode.value if isinstance(mode, InterpolationMode) else str(mode)
            implied.max_size = step.max_size
        elif kind == "CenterCrop":
            height, width = step.size
            if height != width:
                implied.problems.append(f"{where}({(height, width)}): not square; the shim's input is [3, crop, crop]")
                continue
            implied.crop = int(height)
        elif kind == "Normalize":
            implied.mean, implied.std = tuple(float(v) for v in step.mean), tuple(float(v) for v in step.std)
            if len(implied.mean) != 3 or len(implied.std) != 3:
                implied.problems.append(f"{where}: mean/std of {len(implied.mean)} values; the shim takes one per "
                                        "channel (3)")
    for needed in ("Resize", "CenterCrop", "ToTensor"):
        if needed not in seen:
            implied.problems.append(f"no {needed} step: the shim runs " + " -> ".join(order))
    return implied


def differences(implied: Implied, description: ModelDescription) -> list[str]:
    """Where the transform's values and the description's disagree, each with the field to change."""
    rows = [("resize", "Resize's size", implied.resize, description.resize),
            ("interpolation", "Resize's interpolation", implied.interpolation, description.interpolation),
            ("max_size", "Resize's max_size", implied.max_size or 0, description.max_size or 0),
            ("crop", "CenterCrop's size", implied.crop, description.crop),
            ("mean", "Normalize's mean", list(implied.mean), list(description.mean)),
            ("std", "Normalize's std", list(implied.std), list(description.std))]
    return [f"{what}: the legacy transform has {theirs!r}, {description.path} has {ours!r}: set [preprocess] "
            f"{key} = {_toml(theirs)}" for key, what, theirs, ours in rows if theirs is not None and theirs != ours]


def _toml(value: object) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


@dataclass
class Compared:
    name: str
    max_diff: float | None = None  # None: not compared (see note)
    note: str = ""


@dataclass
class Result:
    implied: Implied
    differences: list[str]
    images: list[Compared]

    @property
    def compared(self) -> list[Compared]:
        return [c for c in self.images if c.max_diff is not None]

    @property
    def passed(self) -> bool:
        return (not self.implied.problems and not self.differences and bool(self.compared)
                and all(c.max_diff == 0 for c in self.compared))

    def lines(self) -> list[str]:
        out = []
        for c in self.images:
            if c.max_diff is None:
                out.append(f"  {c.name}: not compared ({c.note})")
            else:
                verdict = "bit-exact" if c.max_diff == 0 else "DIFFERS"
                out.append(f"  {c.name}: max |legacy - shim| = {c.max_diff:.3g} ({verdict}){c.note}")
        if self.passed:
            out.append(f"PASS: {len(self.compared)} images, every tensor bit-exact (max difference 0)")
            return out
        out.append("FAIL:")
        out += [f"  - {problem}" for problem in self.implied.problems]
        out += [f"  - {difference}" for difference in self.differences]
        differing = [c for c in self.compared if c.max_diff]
        if differing:
            worst = max(differing, key=lambda c: c.max_diff or 0.0)
            out.append(f"  - {len(differing)} of {len(self.compared)} images differ (the largest: {worst.name}, "
                       f"{worst.max_diff:.3g})" + ("" if self.implied.problems or self.differences else
                                                   ": the transform's steps match the description, so the "
                                                   "difference is in how the image was opened (color)"))
        if not self.compared:
            out.append("  - no image could be compared")
        return out


def check(transform: Callable[[Any], Any], description: ModelDescription,
          images: Iterable[tuple[str, bytes]]) -> Result:
    """The transform read step by step, then every image both ways: the legacy tensor against the shim's."""
    from PIL import Image

    implied = read_transform(transform)
    spec = description.spec()
    compared = []
    for name, data in images:
        try:
            ours = to_tensor(decode(data, spec), spec)
        except ShimError as e:
            compared.append(Compared(name, note=f"the shim refuses it: {e.code}: {e.message}"))
            continue
        opened = Image.open(io.BytesIO(data))
        theirs = np.asarray(transform(opened.convert("RGB") if description.color == "convert" else
                                      _shim_rgb(opened, spec)))
        if theirs.shape != ours.shape:
            compared.append(Compared(name, note=f"the legacy tensor is {list(theirs.shape)}, the shim's "
                                                f"{list(ours.shape)}"))
            continue
        diff = float(np.abs(theirs.astype(np.float64) - ours.astype(np.float64)).max())
        compared.append(Compared(name, diff, "" if theirs.dtype == np.float32 else f"; legacy dtype {theirs.dtype}"))
    return Result(implied, differences(implied, description), compared)


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
