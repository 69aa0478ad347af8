"""triton_repo/ as committed, and the CPU copy the embedded server makes of it (no server needed)."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from app.preprocess import ImageSpec
from devstack import EmbeddedTriton, EmbeddedTritonConfig, EmbeddedTritonError
from devstack.cpu_repo import cpu_config, read_config, sync_cpu_repo
from devstack.wheel import TritonWheel, find_wheel
from tests.support import ROOT, TRITON_REPO, free_ports

MODELS = sorted(p.parent.name for p in TRITON_REPO.glob("*/config.pbtxt"))


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        h.update(str(path.relative_to(root)).encode())
        if path.is_file() and not path.is_symlink():
            h.update(path.read_bytes())
    return h.hexdigest()


def test_the_repository_holds_what_the_default_description_generates() -> None:
    assert MODELS == ["normalize", "resnet50", "resnet50_decode", "resnet50_encoded", "resnet50_uint8"]


@pytest.mark.parametrize("name", MODELS)
def test_every_config_parses_as_a_model_config_named_after_its_folder(name: str) -> None:
    config = read_config(TRITON_REPO / name / "config.pbtxt")
    assert config.name == name
    assert any(p.is_dir() and p.name.isdigit() for p in (TRITON_REPO / name).iterdir()), "no version folder"


def test_resnet50_config_is_the_articles() -> None:
    c = read_config(TRITON_REPO / "resnet50" / "config.pbtxt")
    assert (c.platform, c.max_batch_size) == ("pytorch_libtorch", 32)
    (inp,), (out,) = c.input, c.output
    assert (inp.name, inp.data_type, list(inp.dims)) == ("input__0", mc.TYPE_FP32, [3, 224, 224])
    assert (out.name, out.data_type, list(out.dims)) == ("output__0", mc.TYPE_FP32, [1000])
    assert out.label_filename == "labels.txt"
    assert [(g.count, g.kind) for g in c.instance_group] == [(2, mc.ModelInstanceGroup.KIND_GPU)]
    assert list(c.dynamic_batching.preferred_batch_size) == [8, 16, 32]
    assert c.dynamic_batching.max_queue_delay_microseconds == 500
    assert c.optimization.input_pinned_memory.enable


def test_the_encoded_ensemble_feeds_the_decode_steps_tensor_to_resnet50() -> None:
    encoded = read_config(TRITON_REPO / "resnet50_encoded" / "config.pbtxt")
    assert encoded.platform == "ensemble"
    (raw,), (logits, readable) = encoded.input, encoded.output
    assert (raw.name, raw.data_type, list(raw.dims)) == ("encoded", mc.TYPE_STRING, [1]), "one upload per row"
    assert (logits.name, logits.data_type, list(logits.dims)) == ("output__0", mc.TYPE_FP32, [1000])
    assert (readable.name, readable.data_type, list(readable.dims)) == ("readable", mc.TYPE_BOOL, [1])
    decode, model = encoded.ensemble_scheduling.step
    assert (decode.model_name, model.model_name) == ("resnet50_decode", "resnet50")
    step = read_config(TRITON_REPO / "resnet50_decode" / "config.pbtxt")
    net = read_config(TRITON_REPO / "resnet50" / "config.pbtxt")
    (inp,), (out, ok) = step.input, step.output
    assert (inp.data_type, list(inp.dims), ok.data_type) == (mc.TYPE_STRING, [1], mc.TYPE_BOOL)
    assert dict(decode.input_map) == {inp.name: "encoded"}
    assert dict(decode.output_map) == {out.name: "decoded", ok.name: "readable"}
    assert dict(model.input_map) == {net.input[0].name: "decoded"}
    assert (out.data_type, list(out.dims)) == (net.input[0].data_type, list(net.input[0].dims))
    assert step.max_batch_size >= encoded.max_batch_size and net.max_batch_size >= encoded.max_batch_size


def test_the_decode_step_reads_the_legacy_transforms_from_its_parameters() -> None:
    """What the model description generates for it: resize, crop, interpolation, mean, std, color (strings)."""
    step = read_config(TRITON_REPO / "resnet50_decode" / "config.pbtxt")
    params = {k: v.string_value for k, v in step.parameters.items()}
    assert set(params) == {"resize", "crop", "interpolation", "mean", "std", "color"}
    spec = ImageSpec()
    assert (int(params["resize"]), int(params["crop"]), params["interpolation"]) == (spec.resize, spec.crop, "bilinear")
    assert tuple(float(x) for x in params["mean"].split(",")) == spec.mean
    assert tuple(float(x) for x in params["std"].split(",")) == spec.std
    assert list(step.output[0].dims) == [3, spec.crop, spec.crop]
    source = (ROOT / "modelrepo" / "triton_models" / "decode.py").read_text()  # every <name>_decode/1/model.py
    for number in ("256", "224", "0.485", "0.229"):  # the numbers live in the config, not the code
        assert number not in source, number


def test_cpu_config_turns_libtorch_into_the_python_stand_in_and_keeps_the_rest() -> None:
    source = read_config(TRITON_REPO / "resnet50" / "config.pbtxt")
    source.optimization.execution_accelerators.gpu_execution_accelerator.add(name="tensorrt")
    cpu = cpu_config(source, cpus=2)
    assert (cpu.platform, cpu.backend) == ("", "python")
    assert [(g.count, g.kind) for g in cpu.instance_group] == [(2, mc.ModelInstanceGroup.KIND_CPU)]
    assert cpu.parameters["SOURCE_MODEL_FILENAME"].string_value == "model.pt"
    assert cpu.parameters["INTRA_OP_THREAD_COUNT"].string_value == "1"  # 2 cores / 2 instances
    assert not cpu.optimization.HasField("execution_accelerators")
    for field in ("name", "max_batch_size", "input", "output", "dynamic_batching"):
        assert getattr(cpu, field) == getattr(source, field), field


def test_cpu_copy_follows_the_source_and_never_writes_into_it(tmp_path: Path) -> None:
    source, target = tmp_path / "repo", tmp_path / "cpu"
    (source / "resnet50" / "1").mkdir(parents=True)
    (source / "resnet50" / "config.pbtxt").write_text((TRITON_REPO / "resnet50" / "config.pbtxt").read_text())
    (source / "resnet50" / "1" / "model.pt").write_bytes(b"weights v1")
    before = tree_digest(source)

    assert sync_cpu_repo(source, target) == ["resnet50"]
    assert (target / "resnet50" / "1" / "model.py").read_text().startswith('"""Python-backend stand-in')
    assert (target / "resnet50" / "1" / "model.pt").resolve() == (source / "resnet50" / "1" / "model.pt")
    assert sync_cpu_repo(source, target) == [], "an unchanged source must not be rewritten"

    (source / "resnet50" / "2").mkdir()
    (source / "resnet50" / "2" / "model.pt").write_bytes(b"weights v2")
    assert sync_cpu_repo(source, target) == ["resnet50"]
    assert (target / "resnet50" / "2" / "model.py").is_file()

    config = source / "resnet50" / "config.pbtxt"
    config.write_text(config.read_text().replace("max_batch_size: 32", "max_batch_size: 16"))
    assert sync_cpu_repo(source, target) == ["resnet50"]
    assert read_config(target / "resnet50" / "config.pbtxt").max_batch_size == 16

    (source / "resnet50" / "2" / "model.pt").unlink()
    (source / "resnet50" / "2").rmdir()
    (source / "resnet50" / "config.pbtxt").rename(source / "resnet50" / "config.off")
    assert sync_cpu_repo(source, target) == ["resnet50"]
    assert not (target / "resnet50").exists(), "a model removed from the source leaves the copy"
    assert list(source.rglob("__pycache__")) == []
    assert tree_digest(source) != before  # (we edited it) but nothing of the copy landed in it:
    assert {p.name for p in source.rglob("*")} == {"resnet50", "1", "model.pt", "config.off"}


def test_cpu_copy_inside_the_source_is_refused(tmp_path: Path) -> None:
    with pytest.raises(EmbeddedTritonError, match="must live outside"):
        sync_cpu_repo(TRITON_REPO, TRITON_REPO / "cpu")


def test_a_missing_model_pt_says_to_run_make_export(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "resnet50" / "1").mkdir(parents=True)
    (repo / "resnet50" / "config.pbtxt").write_text((TRITON_REPO / "resnet50" / "config.pbtxt").read_text())
    server = EmbeddedTriton(EmbeddedTritonConfig(model_repository=repo, cache_dir=tmp_path / "cache"))
    with pytest.raises(EmbeddedTritonError, match=r"model\.pt is missing .*run `make export`"):
        server.start()


def test_a_busy_port_is_named(tmp_path: Path, test_repo: Path) -> None:
    import socket

    http, grpc, metrics = free_ports(3)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", grpc))
        taken.listen()
        config = EmbeddedTritonConfig(model_repository=test_repo, cache_dir=tmp_path, http_port=http,
                                      grpc_port=grpc, metrics_port=metrics)
        with pytest.raises(EmbeddedTritonError, match=rf"gRPC port 127\.0\.0\.1:{grpc} is busy"):
            EmbeddedTriton(config).start()


@pytest.mark.parametrize("python", [(3, 11), (3, 12), (3, 13)])  # requires-python's
def test_each_supported_python_gets_the_stub_built_for_it(python: tuple[int, int]) -> None:
    """The models run in the python-backend stub, which embeds one Python: the wheel's stub of that version,
    linked against that version's libpython (3.12 is Ubuntu 24.04's)."""
    wheel = TritonWheel(root=find_wheel().root, python=python)
    wheel.check()
    assert wheel.stub == wheel.root / "python_backend_stubs" / f"{python[0]}.{python[1]}" / "triton_python_backend_stub"
    assert wheel.stub.is_file() and wheel.stub.stat().st_mode & 0o111
    assert f"libpython{python[0]}.{python[1]}.so".encode() in wheel.stub.read_bytes()
    assert TritonWheel(root=wheel.root).python == sys.version_info[:2]  # by default, the interpreter running


def test_a_python_with_no_stub_is_refused_with_the_versions_there_are() -> None:
    wheel = TritonWheel(root=find_wheel().root, python=(3, 14))
    with pytest.raises(EmbeddedTritonError, match=r"stubs for Python 3\.8, 3\.9, 3\.10, 3\.11, 3\.12, 3\.13, not for "
                                                  r"3\.14, which runs here .*PYTHON=python3\.11"):
        wheel.check()


def test_a_broken_wheel_says_how_to_reinstall(tmp_path: Path) -> None:
    with pytest.raises(EmbeddedTritonError, match=r"tritonserver binary is missing .*make install"):
        TritonWheel(root=tmp_path).check()


def test_three_distinct_ports_are_required(tmp_path: Path) -> None:
    with pytest.raises(EmbeddedTritonError, match="three distinct ports"):
        EmbeddedTritonConfig(model_repository=tmp_path, http_port=8000, grpc_port=8000, metrics_port=8002)


def test_a_config_older_than_its_description_stops_the_embedded_server(tmp_path: Path) -> None:
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(TRITON_REPO / "resnet50", repo / "resnet50",
                    ignore=shutil.ignore_patterns("model.pt", "labels.txt"))
    (repo / "resnet50" / "1").mkdir(exist_ok=True)
    (repo / "resnet50" / "1" / "model.pt").write_bytes(b"weights")
    description = repo / "resnet50" / "model.toml"
    description.write_text(description.read_text().replace('interpolation = "bilinear"', 'interpolation = "bicubic"'))
    server = EmbeddedTriton(EmbeddedTritonConfig(model_repository=repo, cache_dir=tmp_path / "cache"))
    with pytest.raises(EmbeddedTritonError, match=r"config.pbtxt is older than resnet50/model.toml: interpolation "
                                                  r"'bilinear' \(the description: 'bicubic'\)\. Run `python "
                                                  r"modelrepo/export.py --model resnet50`"):
        server.start()


def test_a_decode_step_older_than_its_description_or_the_shims_code_stops_the_embedded_server(tmp_path: Path) -> None:
    import shutil

    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    from devstack.cpu_repo import check_model_files

    repo = tmp_path / "repo"
    for name in ("resnet50", "resnet50_decode"):
        shutil.copytree(TRITON_REPO / name, repo / name, ignore=shutil.ignore_patterns("model.pt", "labels.txt"))
    (repo / "resnet50" / "1").mkdir(exist_ok=True)
    (repo / "resnet50" / "1" / "model.pt").write_bytes(b"weights")
    check_model_files(repo)  # as exported: fine
    config = repo / "resnet50_decode" / "config.pbtxt"
    edited = text_format.Parse(config.read_text(), mc.ModelConfig())
    edited.parameters["interpolation"].string_value = "bicubic"
    del edited.parameters["color"]
    edited.parameters["max_size"].string_value = "300"
    config.write_text(text_format.MessageToString(edited))
    with pytest.raises(EmbeddedTritonError, match=r"resnet50_decode, the decode step of resnet50, is older than "
                                                  r"resnet50/model.toml or the shim: color not served, the "
                                                  r"description says 'convert'; interpolation='bicubic', the "
                                                  r"description says 'bilinear'; max_size='300', which the "
                                                  r"description does not set\. Run `python modelrepo/export.py "
                                                  r"--model resnet50`"):
        check_model_files(repo)
    shutil.copy(TRITON_REPO / "resnet50_decode" / "config.pbtxt", config)
    code = repo / "resnet50_decode" / "1" / "model.py"
    code.write_text(code.read_text() + "\n# an older copy\n")
    with pytest.raises(EmbeddedTritonError, match=r"1/model.py \(not the shim's modelrepo/triton_models/decode.py\)"):
        check_model_files(repo)
    code.unlink()
    with pytest.raises(EmbeddedTritonError, match=r"resnet50_decode/<version>/model.py is missing .*run `make export`"):
        check_model_files(repo)
