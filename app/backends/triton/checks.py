"""What readiness checks of a Triton model: its metadata and config (the JSON Triton serves; no tritonclient
here) against what a transport sends and expects. Each mismatch is a ModelMismatch that says what to change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from app.backends.ensemble import pin_problem
from app.description import compare_parameters
from app.errors import ModelMismatch

NAME = "triton"
READABLE = "readable"  # the encoded ensemble's per-row BOOL output: False where its decoder refused the upload


@dataclass(frozen=True)
class ModelSpec:
    input_name: str
    output_name: str
    max_batch_size: int
    versions: tuple[str, ...]


def check_model(meta: dict[str, Any], config: dict[str, Any], *, image_shape: Sequence[int], classes: int,
                where: str, datatype: str = "FP32", parameters: Mapping[str, str] | None = None) -> ModelSpec:
    """The model's metadata against what the shim sends ([N, *image_shape] of `datatype`) and expects back;
    the preprocessing `parameters` its config serves (generated from the model's description) against the
    shim's own description, where it serves them."""
    want_in = f"{datatype} [-1, {', '.join(map(str, image_shape))}]"
    inp, out = _image_in_logits_out(meta, classes=classes, where=where, want_in=want_in, sender="the shim")
    in_shape = list(inp["shape"])
    if inp["datatype"] != datatype or len(in_shape) != 4 or in_shape[1:] != list(image_shape):
        raise ModelMismatch(f"{where} input '{inp['name']}' is {inp['datatype']} {in_shape}; the shim sends {want_in}",
                            backend=NAME)
    check_parameters(config, parameters or {}, where=where)
    max_batch = int(config.get("max_batch_size", 0)) or (in_shape[0] if in_shape[0] > 0 else 1)
    return ModelSpec(inp["name"], out["name"], max_batch, tuple(meta.get("versions", [])))


def _image_in_logits_out(meta: dict[str, Any], *, classes: int, where: str, want_in: str, sender: str,
                         also: tuple[str, ...] = ()) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's one input and its logits output (FP32 [-1, classes]), checked; `also`: other outputs it needs."""
    outputs = [o for o in meta.get("outputs", []) if o.get("name") not in also]
    named = {o.get("name") for o in meta.get("outputs", [])}
    if len(meta.get("inputs", [])) != 1 or len(outputs) != 1 or not set(also) <= named:
        wanted = " and ".join(["one logits output", *also])
        raise ModelMismatch(f"{where} has {len(meta.get('inputs', []))} inputs and {len(meta.get('outputs', []))} "
                            f"outputs; {sender} needs one image input ({want_in}) and {wanted}", backend=NAME)
    (inp,), (out,) = meta["inputs"], outputs
    out_shape = list(out["shape"])
    if out["datatype"] != "FP32" or len(out_shape) != 2 or out_shape[1] != classes:
        raise ModelMismatch(f"{where} output '{out['name']}' is {out['datatype']} {out_shape}; the shim expects "
                            f"FP32 [-1, {classes}] (one score per label in its labels file)", backend=NAME)
    return inp, out


def check_parameters(config: dict[str, Any], wanted: Mapping[str, str], *, where: str, every: bool = False) -> None:
    """The `parameters` a config serves against the shim's description (app.description.compare_parameters)."""
    served = {k: str(v.get("string_value", "")) for k, v in config.get("parameters", {}).items() if isinstance(v, dict)}
    differ = compare_parameters(served, wanted, every=every, described="the shim's description")
    if differ:
        raise ModelMismatch(f"{where} was generated from another description: {'; '.join(differ)}. Regenerate its "
                            "repository (modelrepo/export.py), or point SHIM_MODEL_REPOSITORY at the one it serves",
                            backend=NAME)


def decode_step_of(config: dict[str, Any], *, model: str, where: str) -> str:
    """The encoded ensemble's decode step: its one step that is not `model`, which the ensemble must feed."""
    steps = [str(step.get("model_name", "")) for step in config.get("ensemble_scheduling", {}).get("step", [])]
    others = [name for name in steps if name != model]
    if model not in steps or len(others) != 1:
        raise ModelMismatch(f"{where} runs {' -> '.join(steps) or 'no ensemble steps'}; the encoded transport needs a "
                            f"decode step -> {model}, the model the shim serves (SHIM_MODEL_NAME)",
                            backend=NAME)
    return others[0]


def check_encoded_model(meta: dict[str, Any], config: dict[str, Any], *, classes: int, where: str) -> ModelSpec:
    """The encoded ensemble: BYTES [-1, 1] in (an upload per row); logits and READABLE BOOL [-1, 1] out."""
    want = "BYTES [-1, 1] (one upload per row)"
    inp, out = _image_in_logits_out(meta, classes=classes, where=where, want_in=want, sender="the encoded transport",
                                    also=(READABLE,))
    if inp["datatype"] != "BYTES" or list(inp["shape"]) != [-1, 1]:
        raise ModelMismatch(f"{where} input '{inp['name']}' is {inp['datatype']} {list(inp['shape'])}; the encoded "
                            f"transport sends {want}: regenerate the repository (modelrepo/export.py)", backend=NAME)
    readable = next(o for o in meta["outputs"] if o.get("name") == READABLE)
    if readable["datatype"] != "BOOL" or list(readable["shape"]) != [-1, 1]:
        raise ModelMismatch(f"{where} output '{READABLE}' is {readable['datatype']} {list(readable['shape'])}; the "
                            "encoded transport expects BOOL [-1, 1]", backend=NAME)
    return ModelSpec(inp["name"], out["name"], int(config.get("max_batch_size", 0)) or 1,
                     tuple(meta.get("versions", [])))


def check_pin(config: dict[str, Any], *, ensemble: str, classifier: str, pin: str, where: str) -> None:
    """An ensemble a transport sends to must run the classifier version that SHIM_MODEL_VERSION pins."""
    problem = pin_problem(config, ensemble=ensemble, classifier=classifier, pin=pin)
    if problem:
        raise ModelMismatch(f"{where}: {problem}", backend=NAME)
