"""docker/triton.Dockerfile's Python stack: one its Triton's python backend can use, and the one the decode step
is tested with (requirements/dev.txt, which make test runs inside the same server version, the wheel's 2.51)."""

from __future__ import annotations

import re

from tests.support import ROOT

DECODE_STACK = ("numpy", "torch", "torchvision", "nvidia-nvimgcodec-cu13")
FIRST_NUMPY2_RELEASE = (24, 11)  # python_backend #384 (pybind11 2.12) is in r24.11 and later


def pins(lock: str) -> dict[str, str]:
    text = (ROOT / "requirements" / f"{lock}.txt").read_text()
    return dict(re.findall(r"^([A-Za-z0-9_.\-]+)==([^\s\\;]+)", text, re.MULTILINE))


def base_release() -> tuple[int, int]:
    dockerfile = (ROOT / "docker" / "triton.Dockerfile").read_text()
    (tag,) = re.findall(r"^ARG TRITON_IMAGE=nvcr\.io/nvidia/tritonserver:(\d+)\.(\d+)-py3$", dockerfile, re.MULTILINE)
    return int(tag[0]), int(tag[1])


def numpy_major(lock: str) -> int:
    return int(pins(lock)["numpy"].split(".")[0])


def test_a_base_before_24_11_gets_numpy_below_2() -> None:
    """Triton 24.10's python backend stub (pybind11 2.10) misreads or refuses numpy 2 arrays: the decode step
    would fail on every upload and the shim would decode them all on its own CPU."""
    if base_release() < FIRST_NUMPY2_RELEASE:
        numpy = pins("triton-image")["numpy"]
        assert numpy_major("triton-image") < 2, (f"requirements/triton-image.txt pins numpy {numpy} for tritonserver "
                                                 f"{base_release()}, whose python backend needs numpy<2")


def test_the_check_reads_the_files_it_guards() -> None:
    assert base_release() == (24, 10)
    assert "torch" in pins("triton-image") and "numpy" in pins("triton-image")


def test_the_image_runs_the_decode_step_with_the_versions_make_test_runs() -> None:
    image, dev = pins("triton-image"), pins("dev")
    assert {p: image.get(p) for p in DECODE_STACK} == {p: dev.get(p) for p in DECODE_STACK}
    dockerfile = (ROOT / "docker" / "triton.Dockerfile").read_text()
    assert "requirements/triton-image.txt" in dockerfile and "--require-hashes" in dockerfile
