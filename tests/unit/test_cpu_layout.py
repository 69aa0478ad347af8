"""The CPU copy's instance layout of a libtorch model: the config's narrow instances, or one instance with every
core where this machine runs that faster (devstack/cpu_layout.py)."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from devstack import cpu_layout
from devstack.cpu_layout import Layout, choose
from devstack.cpu_repo import cpu_config, read_config, sync_cpu_repo
from tests.support import TRITON_REPO

# Seconds per image of one ResNet-50 forward (batch 4), one instance alone, measured on two machines.
EPYC_2026_12_05 = {1: 0.0731, 2: 0.0302}  # torch skips oneDNN for 1x1 convolutions on one thread
SCALES_NORMALLY = {1: 0.150, 2: 0.085}


def test_one_wide_instance_where_it_serves_more_than_the_narrow_ones_could() -> None:
    chosen, other = choose(cpus=2, instances=2, seconds_per_image=EPYC_2026_12_05)
    assert (chosen.instances, chosen.threads) == (1, 2)
    assert (other.instances, other.threads) == (2, 1)
    assert chosen.images_per_s == pytest.approx(1 / 0.0302) and other.images_per_s == pytest.approx(2 / 0.0731)


def test_the_configs_instances_where_threads_scale_as_usual() -> None:
    chosen, other = choose(cpus=2, instances=2, seconds_per_image=SCALES_NORMALLY)
    assert (chosen.instances, chosen.threads) == (2, 1)
    assert (other.instances, other.threads) == (1, 2)
    chosen, _ = choose(cpus=8, instances=2, seconds_per_image={4: 0.020, 8: 0.012})  # 100 against 83 images/s
    assert (chosen.instances, chosen.threads) == (2, 4)
    chosen, _ = choose(cpus=2, instances=2, seconds_per_image={1: 0.020, 2: 0.0095})  # 105 against 100: a draw
    assert (chosen.instances, chosen.threads) == (2, 1), "the config's layout, unless the other clearly wins"


def test_the_layout_sets_the_instance_count_and_threads_unless_the_config_names_a_thread_count() -> None:
    source = read_config(TRITON_REPO / "resnet50" / "config.pbtxt")
    cpu = cpu_config(source, cpus=2, layout=Layout(1, 2))
    assert [g.count for g in cpu.instance_group] == [1]
    assert cpu.parameters["INTRA_OP_THREAD_COUNT"].string_value == "2"
    source.parameters["INTRA_OP_THREAD_COUNT"].string_value = "1"  # the author's choice stands
    cpu = cpu_config(source, cpus=2, layout=Layout(1, 2))
    assert [g.count for g in cpu.instance_group] == [2]
    assert cpu.parameters["INTRA_OP_THREAD_COUNT"].string_value == "1"


def tiny_repo(root: Path, model_pt: Path) -> Path:
    """triton_repo's resnet50 config, with a small TorchScript model of its input shape as version 1."""
    (root / "resnet50" / "1").mkdir(parents=True)
    (root / "resnet50" / "config.pbtxt").write_text((TRITON_REPO / "resnet50" / "config.pbtxt").read_text())
    shutil.copy(model_pt, root / "resnet50" / "1" / "model.pt")
    return root


@pytest.fixture()
def small_model(tmp_path: Path) -> Path:
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=4), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(8, 1000))
    path = tmp_path / "small.pt"
    torch.jit.script(model.eval()).save(str(path))
    return path


@pytest.fixture()
def layout_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A cache file of the test's own, as a fresh process sees it; the machine counts as quiet."""
    cache = tmp_path / "cpu_layouts.json"
    monkeypatch.setattr(cpu_layout, "CACHE", cache)
    monkeypatch.setattr(cpu_layout, "_TIMED", {})
    monkeypatch.setattr(cpu_layout, "QUIET_LOAD", float("inf"))
    cpu_layout.decide.cache_clear()
    yield cache
    cpu_layout.decide.cache_clear()


def test_the_copy_is_timed_once_per_model_and_says_its_layout(tmp_path: Path, small_model: Path,
                                                              layout_cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="embedded_triton"):
        sync_cpu_repo(tiny_repo(tmp_path / "repo", small_model), tmp_path / "cpu", cpus=2)
    (timings,) = json.loads(layout_cache.read_text()).values()
    assert set(timings) == {"1", "2"} and all(0 < v < 10 for v in timings.values()), timings
    chosen, other = choose(2, 2, {int(k): v for k, v in timings.items()})
    config_text = (tmp_path / "cpu" / "resnet50" / "config.pbtxt").read_text()
    assert f"# On this machine's 2 cores: {chosen}, faster here than {other}" in config_text
    assert f"the CPU copy of resnet50 runs {chosen}, faster here than {other}" in caplog.text  # make run's log
    config = read_config(tmp_path / "cpu" / "resnet50" / "config.pbtxt")
    assert [g.count for g in config.instance_group] == [chosen.instances]
    assert config.parameters["INTRA_OP_THREAD_COUNT"].string_value == str(chosen.threads)

    # The same weights in another repository, in a new process: read from the cache, not timed again.
    cpu_layout.decide.cache_clear()
    monkeypatch.setattr(cpu_layout, "_TIMED", {})
    monkeypatch.setattr(cpu_layout, "_measure", lambda *a: pytest.fail("timed again"))
    sync_cpu_repo(tiny_repo(tmp_path / "other", small_model), tmp_path / "cpu2", cpus=2)
    assert (tmp_path / "cpu2" / "resnet50" / "config.pbtxt").read_text().splitlines()[1:] == \
        config_text.splitlines()[1:]


def test_weights_that_cannot_run_keep_the_configs_layout_and_are_not_remembered(tmp_path: Path,
                                                                                layout_cache: Path) -> None:
    broken = tmp_path / "broken.pt"
    broken.write_bytes(b"not a TorchScript archive")
    sync_cpu_repo(tiny_repo(tmp_path / "repo", broken), tmp_path / "cpu", cpus=2)
    config_text = (tmp_path / "cpu" / "resnet50" / "config.pbtxt").read_text()
    assert "the config's layout (the timing failed: exit 1:" in config_text
    config = read_config(tmp_path / "cpu" / "resnet50" / "config.pbtxt")
    assert [g.count for g in config.instance_group] == [2]
    assert config.parameters["INTRA_OP_THREAD_COUNT"].string_value == "1"
    assert not layout_cache.exists()


def test_a_timing_on_a_busy_machine_serves_this_process_only(tmp_path: Path, small_model: Path,
                                                              layout_cache: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_layout, "QUIET_LOAD", -1.0)  # any load average is too busy
    sync_cpu_repo(tiny_repo(tmp_path / "repo", small_model), tmp_path / "cpu", cpus=2)
    assert "faster here than" in (tmp_path / "cpu" / "resnet50" / "config.pbtxt").read_text()
    assert not layout_cache.exists(), "a busy machine's timing must not be remembered for the next start"

    cpu_layout.decide.cache_clear()  # another repository in the same process: its timing is reused
    monkeypatch.setattr(cpu_layout, "_measure", lambda *a: pytest.fail("timed again"))
    sync_cpu_repo(tiny_repo(tmp_path / "other", small_model), tmp_path / "cpu2", cpus=2)
    assert "faster here than" in (tmp_path / "cpu2" / "resnet50" / "config.pbtxt").read_text()
