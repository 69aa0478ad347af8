"""The model description (app/description.py): its readers, the files generated from it, and its errors.

One description, many readers: the committed configs of triton_repo/ must be exactly what modelrepo/generate.py
writes from triton_repo/resnet50/model.toml, and a wrong description stops the export or the shim's start with
a message that names the field and the fix.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from app.description import DescriptionError, load, parse, resolve
from app.preprocess import ImageSpec
from app.settings import Settings
from modelrepo import export as export_model
from modelrepo import generate as model_repo
from tests.support import ROOT, TRITON_REPO

EXAMPLES = sorted((ROOT / "examples" / "models").glob("*/model.toml"))
DEFAULT = TRITON_REPO / "resnet50" / "model.toml"


def write(folder: Path, text: str, name: str = "mymodel") -> Path:
    path = folder / name / "model.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'name = "{name}"\n' + text)
    return path


def test_the_committed_configs_are_what_the_default_description_generates() -> None:
    description = load(DEFAULT)
    files = model_repo.generated_files(description)
    assert set(files) == {Path("resnet50/config.pbtxt"), Path("resnet50/configs/cpu.pbtxt"),
                          Path("normalize/config.pbtxt"), Path("normalize/configs/cpu.pbtxt"),
                          Path("resnet50_uint8/config.pbtxt"), Path("resnet50_uint8/1/README.md"),
                          Path("resnet50_decode/config.pbtxt"), Path("resnet50_decode/configs/cpu.pbtxt"),
                          Path("resnet50_decode/1/model.py"), Path("resnet50_encoded/config.pbtxt"),
                          Path("resnet50_encoded/1/README.md")}
    committed = subprocess.run(["git", "ls-files", "triton_repo"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.split()
    for rel, text in files.items():
        if model_repo.copied(rel):  # the decode step's code: a copy the export writes, never committed
            assert f"triton_repo/{rel.as_posix()}" not in committed, rel
            assert text == (ROOT / "modelrepo" / "triton_models" / "decode.py").read_text()
            continue
        assert f"triton_repo/{rel.as_posix()}" in committed, rel
        assert (TRITON_REPO / rel).read_text() == text, f"{rel} differs: `python modelrepo/export.py --configs-only`"
    ignored = subprocess.run(["git", "check-ignore", "-q", "triton_repo/resnet50_decode/1/model.py"], cwd=ROOT,
                             check=False)
    assert ignored.returncode == 0, "the decode step's model.py copy must be ignored by git"


def test_make_export_leaves_nothing_stale() -> None:
    stale = model_repo.stale(load(DEFAULT), TRITON_REPO)  # the model.py copy included: `make export` writes it
    assert stale == [], f"{stale}: run `make export` (or modelrepo/export.py --configs-only)"


def test_the_defaults_are_todays_resnet50() -> None:
    d = load(DEFAULT)
    assert (d.name, d.resize, d.crop, d.interpolation, d.mean, d.std) == (
        "resnet50", 256, 224, "bilinear", (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    assert (d.classes, d.scores, d.top_k, d.uint8_model, d.normalize_model) == (
        1000, "softmax", 5, "resnet50_uint8", "normalize")
    spec = ImageSpec.of(d)
    assert (spec.resize, spec.crop, spec.interpolation, spec.shape) == (256, 224, "bilinear", (3, 224, 224))
    assert d.parameters() == {"resize": "256", "crop": "224", "interpolation": "bilinear",
                              "mean": "0.485,0.456,0.406", "std": "0.229,0.224,0.225", "color": "convert",
                              "scores": "softmax"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.parent.name)
def test_the_example_descriptions_are_valid_and_differ_from_resnet50(path: Path) -> None:
    d = load(path)
    assert d.name == path.parent.name
    assert (d.resize, d.interpolation, d.mean, d.classes, d.resize_on) != (256, "bilinear", (0.485, 0.456, 0.406),
                                                                         1000, "pil")
    files = model_repo.generated_files(d)
    config = text_format.Parse(files[Path(d.name, "config.pbtxt")], mc.ModelConfig())
    assert (config.name, list(config.output[0].dims)) == (d.name, [d.classes])
    assert config.parameters["interpolation"].string_value == d.interpolation
    uint8 = text_format.Parse(files[Path(d.uint8_model, "config.pbtxt")], mc.ModelConfig())
    assert uint8.ensemble_scheduling.step[0].model_name == d.normalize_model


def test_a_model_with_its_own_mean_and_std_gets_its_own_normalize_step() -> None:
    effnet = load(ROOT / "examples" / "models" / "efficientnet_lite0" / "model.toml")
    mobilenet = load(ROOT / "examples" / "models" / "mobilenet_v3_small" / "model.toml")
    assert effnet.normalize_model == "efficientnet_lite0_normalize" and mobilenet.normalize_model == "normalize"
    assert effnet.mean == (127 / 255,) * 3 and effnet.std == (128 / 255,) * 3  # the TF original's 127 and 128
    # The shared step is the same file whichever description writes it.
    shared = model_repo.generated_files(mobilenet)[Path("normalize/config.pbtxt")]
    assert shared == (TRITON_REPO / "normalize" / "config.pbtxt").read_text()


def test_the_encoded_transports_models_are_generated_from_the_same_description() -> None:
    """<name>_decode carries every pixel-changing field of [preprocess]; <name>_encoded feeds it to the model."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    d = load(ROOT / "examples" / "models" / "mobilenet_v3_small" / "model.toml")
    files = model_repo.generated_files(d)
    step = text_format.Parse(files[Path("mobilenet_v3_small_decode/config.pbtxt")], mc.ModelConfig())
    assert {k: v.string_value for k, v in step.parameters.items()} == {
        "resize": "232", "crop": "224", "interpolation": "bicubic", "mean": "0.485,0.456,0.406",
        "std": "0.229,0.224,0.225", "color": "convert"}
    assert (step.name, step.backend, list(step.output[0].dims)) == ("mobilenet_v3_small_decode", "python",
                                                                    [3, 224, 224])
    ensemble = text_format.Parse(files[Path("mobilenet_v3_small_encoded/config.pbtxt")], mc.ModelConfig())
    assert [s.model_name for s in ensemble.ensemble_scheduling.step] == ["mobilenet_v3_small_decode",
                                                                         "mobilenet_v3_small"]
    assert list(ensemble.output[0].dims) == [10]
    # The ensembles' model step is one template: a version pin there holds for uint8 and encoded alike.
    uint8 = text_format.Parse(files[Path("mobilenet_v3_small_uint8/config.pbtxt")], mc.ModelConfig())
    last = [e.ensemble_scheduling.step[-1] for e in (uint8, ensemble)]
    assert [(m.model_name, m.model_version, dict(m.output_map)) for m in last] == [
        ("mobilenet_v3_small", -1, {"output__0": "output__0"})] * 2
    assert [dict(m.input_map) for m in last] == [{"input__0": "normalized"}, {"input__0": "decoded"}]
    assert files[Path("mobilenet_v3_small_decode/1/model.py")] == model_repo.DECODE_SOURCE.read_text()
    assert parse({"name": "x", "model": {"torchvision": "resnet18"}, "preprocess": {"max_size": 300}},
                 Path("/repo/x/model.toml")).decode_parameters()["max_size"] == "300"


@pytest.mark.parametrize(("text", "says"), [
    ('[model]\ntorchvision = "resnet18"\n[preprocess]\ninterpolation = "bicubical"\n',
     r"\[preprocess\] interpolation = 'bicubical' is not valid: expected a torchvision InterpolationMode name: "
     r"nearest \| nearest-exact \| bilinear \| bicubic"),
    ('[model]\ntorchvision = "resnet18"\n[preprocess]\nresize = 200\ncrop = 224\n',
     r"\[preprocess\] crop = 224 is not valid: expected at most resize = 200"),
    ('[model]\ntorchvision = "resnet18"\n[preprocess]\nmean = [0.5, 0.5]\n',
     r"\[preprocess\] mean = \[0.5, 0.5\] is not valid: expected three numbers"),
    ('[model]\ntorchvision = "resnet18"\n[output]\nscores = "argmax"\n',
     r"\[output\] scores = 'argmax' is not valid: expected softmax \| sigmoid \| probabilities"),
    ('[model]\ntorchvision = "resnet18"\n[output]\nclases = 10\n',
     r"\[output\] clases = 10 is not valid: expected no such field here \(known: .*classes"),
    ('[model]\ntorchvision = "resnet18"\ntorchscript = "m.pt"\n', r"expected exactly one of them"),
    ('[model]\n', r"torchvision \| torchscript \| efficientnet_lite = 'none' is not valid"),
    ('[model]\ntorchvision = "resnet18"\n[output]\nclasses = 10\ntop_k = 11\n',
     r"\[output\] top_k = 11 is not valid: expected a whole number from 1 to 10"),
    ('[model]\ntorchvision = "resnet18"\n[triton]\nmax_batch_size = 16\npreferred_batch_size = [8, 32]\n',
     r"\[triton\] preferred_batch_size = \[8, 32\] is not valid: expected a list of whole numbers from 1 to "
     r"max_batch_size \(16\)"),
])
def test_a_wrong_description_names_the_field_and_the_fix(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(DescriptionError, match=says):
        load(write(tmp_path, text))


def test_the_name_must_be_the_folders(tmp_path: Path) -> None:
    path = write(tmp_path, '[model]\ntorchvision = "resnet18"\n')
    path.write_text(path.read_text().replace('name = "mymodel"', 'name = "other"'))
    with pytest.raises(DescriptionError, match=r"name = 'other' is not valid: expected the name of the folder "
                                               r"that holds it, 'mymodel'"):
        load(path)


def test_the_shim_does_not_start_on_a_description_its_labels_contradict(tmp_path: Path) -> None:
    write(tmp_path, '[model]\ntorchvision = "resnet18"\n[output]\nclasses = 1000\n')
    (tmp_path / "mymodel" / "labels.txt").write_text("".join(f"product {i}\n" for i in range(37)))
    settings = Settings(model_repository=tmp_path, model_name="mymodel")
    with pytest.raises(DescriptionError, match=r"labels.txt has 37 labels, but .*model.toml says \[output\] "
                                               r"classes = 1000: one label per output class"):
        resolve(settings)
    from app import create_app

    with pytest.raises(DescriptionError, match="37 labels"):
        create_app(settings)
    missing = Settings(model_repository=tmp_path, model_name="nothing")
    with pytest.raises(DescriptionError, match=r"no model description at .*nothing/model.toml: write one"):
        resolve(missing)


def test_labels_top_k_and_the_legacy_model_come_from_the_description_alone(tmp_path: Path) -> None:
    write(tmp_path, '[model]\ntorchvision = "resnet18"\n[output]\nclasses = 3\ntop_k = 2\n')
    (tmp_path / "mymodel" / "labels.txt").write_text("a\nb\nc\n")
    served = resolve(Settings(model_repository=tmp_path, model_name="mymodel"))
    assert (served.labels, served.top_k, served.legacy_model_path) == (("a", "b", "c"), 2,
                                                                       tmp_path / "mymodel" / "1" / "model.pt")
    assert (served.description.uint8_model, served.description.encoded_model) == ("mymodel_uint8", "mymodel_encoded")


def test_a_served_config_from_another_description_is_named() -> None:
    d = load(ROOT / "examples" / "models" / "mobilenet_v3_small" / "model.toml")
    served = {**d.parameters(), "interpolation": "bilinear"}
    assert d.differences(served) == [f"interpolation='bilinear', {d.path} says 'bicubic'"]
    assert d.differences({"other": "1"}) == []  # a hand-written config without parameters is not compared


# -- the export stops on a description its model or labels contradict -------------------------------------------

def tiny_torchscript(path: Path, size: int, classes: int) -> Path:
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = 3 * size * size
            self.fc = torch.nn.Linear(self.features, classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x.reshape(x.shape[0], self.features))

    torch.jit.save(torch.jit.script(Tiny().eval()), str(path))
    return path


def export(argv: list[str]) -> str:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        export_model.main(argv)
    return out.getvalue()


def test_a_torchscript_file_is_checked_by_running_it_once(tmp_path: Path) -> None:
    tiny = tiny_torchscript(tmp_path / "tiny.pt", 32, 4)

    def model(text: str, name: str = "mymodel") -> Path:
        path = write(tmp_path, '[model]\ntorchscript = "tiny.pt"\n' + text, name=name)
        shutil.copy(tiny, path.parent / "tiny.pt")
        (path.parent / "labels.txt").write_text("a\nb\nc\nd\n")
        (path.parent / "ten.txt").write_text("".join(f"c{i}\n" for i in range(10)))
        return path

    labels = "[output]\nclasses = 4\ntop_k = 2\nlabels_from = \"labels.txt\"\n"
    good = model('[preprocess]\nresize = 36\ncrop = 32\n' + labels)
    repo = tmp_path / "repo"
    printed = export([str(good), "--repo", str(repo)])
    assert "wrote" in printed and (repo / "mymodel" / "1" / "model.pt").is_file()
    assert (repo / "mymodel" / "labels.txt").read_text() == "a\nb\nc\nd\n"
    assert (repo / "mymodel" / "model.toml").read_text() == good.read_text()
    assert model_repo.stale(load(repo / "mymodel" / "model.toml"), repo) == []

    wrong_dims = model(labels, name="wrongdims")
    with pytest.raises(SystemExit, match=r"does not take FP32 \[1, 3, 224, 224\], the input .*wrongdims/model.toml "
                                         r"implies \(\[preprocess\] crop = 224\).*Set crop to the size the model "):
        export([str(wrong_dims), "--repo", str(repo)])
    wrong_classes = model('[preprocess]\nresize = 36\ncrop = 32\n'
                          '[output]\nclasses = 10\nlabels_from = "imagenet"\n', name="wrongclasses")
    with pytest.raises(SystemExit, match=r"has 1000 labels, but .*says \[output\] classes = 10"):
        export([str(wrong_classes), "--repo", str(repo)])
    wrong_output = model('[preprocess]\nresize = 36\ncrop = 32\n'
                         '[output]\nclasses = 10\nlabels_from = "ten.txt"\n', name="wrongoutput")
    with pytest.raises(SystemExit, match=r"answers \[1, 4\] for an input \[1, 3, 32, 32\]; .*says \[output\] "
                                         r"classes = 10: set classes to the model's output size"):
        export([str(wrong_output), "--repo", str(repo)])
    assert not any((repo / n).exists() for n in ("wrongdims", "wrongclasses", "wrongoutput")), "nothing written"


@pytest.mark.parametrize(("section", "field", "value"), [
    ("output", "labels", "../../etc/passwd"), ("output", "labels", "/etc/passwd"),
    ("output", "labels", 'l.txt" } parameters { key: "x'), ("output", "labels", "a\nb.txt"),
    ("output", "labels_from", "../x.txt"), ("output", "labels_from", "/etc/hosts"),
    ("model", "weights", "../w.pth"), ("model", "weights", "/w.pth")])
def test_a_path_that_leaves_the_folder_or_carries_quotes_stops_with_one_line_naming_the_field(
        tmp_path: Path, section: str, field: str, value: str) -> None:
    model = '[model]\ntorchvision = "resnet18"\n' + (f'{field} = {json.dumps(value)}\n' if section == "model" else "")
    out = f'[output]\n{field} = {json.dumps(value)}\n' if section == "output" else ""
    path = write(tmp_path, model + out)
    with pytest.raises(DescriptionError, match=rf"\[{section}\] {field} = .* is not valid: expected .*inside the "
                                               "description's folder") as e:
        load(path)
    assert "\n" not in str(e.value)


def test_a_torchscript_path_outside_the_folder_is_refused(tmp_path: Path) -> None:
    for value in ("../m.pt", "/m.pt", "a/../../m.pt"):
        with pytest.raises(DescriptionError, match=r"\[model\] torchscript = .* inside the description's folder"):
            load(write(tmp_path, f'[model]\ntorchscript = "{value}"\n'))


def test_37_labels_for_a_1000_class_output_stop_the_export(tmp_path: Path) -> None:
    path = write(tmp_path, '[model]\ntorchvision = "resnet18"\n[output]\nclasses = 1000\nlabels = "labels.txt"\n')
    (path.parent / "labels.txt").write_text("".join(f"product {i}\n" for i in range(37)))
    with pytest.raises(SystemExit, match=r"labels.txt has 37 labels, but .*model.toml says \[output\] classes = "
                                         r"1000: one label per output class"):
        export([str(path), "--repo", str(tmp_path)])
    assert not (path.parent / "1").exists()


def test_a_torchvision_architecture_exports_with_its_class_count(tmp_path: Path) -> None:
    path = write(tmp_path, '[model]\ntorchvision = "mobilenet_v3_small"\n[preprocess]\nresize = 72\ncrop = 64\n'
                 '[output]\nclasses = 10\nlabels_from = "labels.txt"\n[triton]\ninstances = 1\n', name="small")
    (path.parent / "labels.txt").write_text("".join(f"c{i}\n" for i in range(10)))
    export([str(path), "--repo", str(tmp_path)])
    info = export_model.read_export_info(tmp_path / "small" / "1" / "model.pt")
    assert info is not None and (info["arch"], info["num_classes"], info["seed"]) == ("mobilenet_v3_small", 10, 0)
    config = text_format.Parse((tmp_path / "small" / "config.pbtxt").read_text(), mc.ModelConfig())
    assert (list(config.input[0].dims), list(config.output[0].dims), config.instance_group[0].count) == (
        [3, 64, 64], [10], 1)
    assert "kept" in export([str(path), "--repo", str(tmp_path)]), "a current model.pt is not exported again"


def test_parse_accepts_an_in_memory_table() -> None:
    d = parse({"name": "x", "model": {"torchvision": "resnet18"}, "preprocess": {"max_size": 300}},
              Path("/repo/x/model.toml"))
    assert d.max_size == 300 and d.parameters()["max_size"] == "300"


def test_the_forms_fields_read_and_their_wrong_values_name_the_field(tmp_path: Path) -> None:
    def pre(text: str) -> Any:
        return load(write(tmp_path, '[model]\ntorchvision = "resnet18"\n[preprocess]\n' + text))

    squash = pre("resize = [224, 224]\n")
    assert (squash.resize, squash.crop, squash.input_shape) == ((224, 224), (224, 224), (3, 224, 224))
    wide = pre("resize = [256, 320]\ncrop = [224, 288]\n")
    assert wide.input_shape == (3, 224, 288) and wide.parameters()["crop"] == "224,288"
    v2 = pre('resize_on = "tensor"\nto_float = "multiply"\n')
    assert v2.tolerance > 0 and pre("").tolerance == 0
    assert ImageSpec.of(v2).to_float == "multiply" and v2.parameters()["resize_on"] == "tensor"
    refused = {'resize_on = "tensor"\nantialias = false\n': r"\[preprocess\] antialias = False is not valid",
               'resize_on = "tensor"\ninterpolation = "nearest"\n': r"interpolation = 'nearest' .*resize_on",
               'resize_on = "gpu"\n': r"resize_on = 'gpu' is not valid: expected pil .* \| tensor",
               'to_float = "round"\n': r"to_float = 'round' is not valid: expected divide",
               "resize = [224, 224]\nmax_size = 300\n": r"max_size = 300 .*fixed-size resize",
               "resize = [256, 320]\ncrop = [224, 330]\n": r"crop = \(224, 330\) .*at most resize",
               "resize = [256]\n": r"resize = \[256\] is not valid: expected a whole number .* or \[height, width\]",
               "antialias = 1\n": r"antialias = 1 is not valid: expected true or false"}
    for text, says in refused.items():
        with pytest.raises(DescriptionError, match=says):
            pre(text)


def test_the_dynamic_batchers_tuning_is_written_into_every_config_that_batches() -> None:
    """What perf_analyzer or Model Analyzer found goes in [triton]; the model's and the decode step's configs follow."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    d = parse({"name": "x", "model": {"torchvision": "resnet18"},
               "triton": {"preferred_batch_size": [4, 12], "max_queue_delay_microseconds": 2000, "instances": 3}},
              Path("/repo/x/model.toml"))
    files = model_repo.generated_files(d)
    model = text_format.Parse(files[Path("x/config.pbtxt")], mc.ModelConfig())
    decode = text_format.Parse(files[Path("x_decode/config.pbtxt")], mc.ModelConfig())
    assert list(model.dynamic_batching.preferred_batch_size) == [4, 12]
    assert [c.dynamic_batching.max_queue_delay_microseconds for c in (model, decode)] == [2000, 2000]
    assert [c.instance_group[0].count for c in (model, decode)] == [3, 3]
    default = text_format.Parse(model_repo.generated_files(parse(
        {"name": "x", "model": {"torchvision": "resnet18"}}, Path("/repo/x/model.toml")))[Path("x/config.pbtxt")],
        mc.ModelConfig())
    assert (list(default.dynamic_batching.preferred_batch_size),
            default.dynamic_batching.max_queue_delay_microseconds) == ([8, 16, 32], 500)
    assert not default.dynamic_batching.HasField("default_queue_policy") and not default.HasField("response_cache")


def test_the_queue_policy_and_the_response_cache_are_written_where_triton_reads_them() -> None:
    d = parse({"name": "x", "model": {"torchvision": "resnet18"},
               "triton": {"queue_timeout_microseconds": 80_000, "max_queue_size": 256, "response_cache": True}},
              Path("/repo/x/model.toml"))
    files = model_repo.generated_files(d)
    model, decode, cpu = (text_format.Parse(files[Path(rel)], mc.ModelConfig())
                          for rel in ("x/config.pbtxt", "x_decode/config.pbtxt", "x/configs/cpu.pbtxt"))
    for config in (model, decode, cpu):  # every config that batches; a request past either bound is refused
        policy = config.dynamic_batching.default_queue_policy
        assert (policy.timeout_action, policy.default_timeout_microseconds, policy.max_queue_size) == (
            mc.ModelQueuePolicy.REJECT, 80_000, 256)
    assert model.response_cache.enable and cpu.response_cache.enable and not decode.HasField("response_cache")
    with pytest.raises(DescriptionError, match=r"\[triton\] response_cache"):
        parse({"name": "x", "model": {"torchvision": "resnet18"}, "triton": {"response_cache": "yes"}},
              Path("/repo/x/model.toml"))


def test_a_link_out_of_the_models_folder_stops_the_export_naming_the_field(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("".join(f"s{i}\n" for i in range(4)))
    path = write(tmp_path, '[model]\ntorchvision = "resnet18"\n'
                           '[output]\nclasses = 4\ntop_k = 2\nlabels_from = "team.txt"\n')
    (path.parent / "team.txt").symlink_to(secret)
    with pytest.raises(SystemExit, match=r"\[output\] labels_from = 'team.txt' resolves to .*secret.txt, outside "
                                         r"the model's folder"):
        export([str(path), "--repo", str(tmp_path / "repo")])
    assert not (tmp_path / "repo").exists()
