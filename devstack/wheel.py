"""Find the Triton server that the `nvidia-pytriton` wheel ships, and the environment it needs."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from devstack.errors import EmbeddedTritonError

INSTALL_HINT = "run `make install` (or `pip install -e '.[local-triton]'`)"


Version = tuple[int, int]


def running_python() -> Version:
    return sys.version_info.major, sys.version_info.minor


@dataclass(frozen=True, kw_only=True)
class TritonWheel:
    root: Path  # site-packages/pytriton/tritonserver
    python: Version = field(default_factory=running_python)  # whose stub: the interpreter that runs the models

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def python_backend(self) -> Path:
        return self.root / "backends" / "python"

    @property
    def caches(self) -> Path:
        return self.root / "caches"

    @property
    def stub(self) -> Path:
        """The python-backend stub built for `python`: it embeds that interpreter (links its libpython)."""
        return self.root / "python_backend_stubs" / f"{self.python[0]}.{self.python[1]}" / "triton_python_backend_stub"

    def stub_pythons(self) -> list[Version]:
        """The Python versions the wheel has a stub for (0.7.0: 3.8 to 3.13)."""
        return sorted((3, int(d.name[2:])) for d in (self.root / "python_backend_stubs").glob("3.*")
                      if d.name[2:].isdigit() and (d / "triton_python_backend_stub").is_file())

    def check(self) -> None:
        for path, what in [(self.binary, "the tritonserver binary"),
                           (self.python_backend / "libtriton_python.so", "the python backend")]:
            if not path.exists():
                raise EmbeddedTritonError(f"{what} is missing from the nvidia-pytriton wheel ({path}); "
                                          f"reinstall it: {INSTALL_HINT}")
        if not self.stub.exists():
            has = self.stub_pythons()
            if has and self.python not in has:
                raise EmbeddedTritonError(
                    f"the nvidia-pytriton wheel has python backend stubs for Python "
                    f"{', '.join(f'{a}.{b}' for a, b in has)}, not for {self.python[0]}.{self.python[1]}, which runs "
                    "here (the models run in the stub, on this interpreter): make the virtualenv with one of those, "
                    "e.g. make install PYTHON=python3.11")
            raise EmbeddedTritonError(f"a python backend stub for Python {self.python[0]}.{self.python[1]} is missing "
                                      f"from the nvidia-pytriton wheel ({self.stub}); reinstall it: {INSTALL_HINT}")

    def backend_directory(self, into: Path) -> Path:
        """`<into>/python/`: links to the backend, its utils and the stub side by side (the backend looks for its
        stub only next to libtriton_python.so; the wheel keeps one per Python version elsewhere)."""
        python_dir = into / "python"
        python_dir.mkdir(parents=True, exist_ok=True)
        for source in [self.python_backend / "libtriton_python.so",
                       self.python_backend / "triton_python_backend_utils.py", self.stub]:
            link = python_dir / source.name
            if link.is_symlink() and link.resolve() == source.resolve():
                continue
            if link.exists() or link.is_symlink():
                link.unlink()
            link.symlink_to(source)
        return into


def find_wheel() -> TritonWheel:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedTritonError(f"nvidia-pytriton is not installed in {sys.executable}; {INSTALL_HINT}")
    wheel = TritonWheel(root=Path(next(iter(spec.submodule_search_locations))) / "tritonserver")
    wheel.check()
    return wheel


def server_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver so that python-backend stubs run this interpreter's packages: the stub finds
    site-packages through the first `python3` on PATH (its pyvenv.cfg), and must load this libpython (LIBDIR)."""
    env = dict(os.environ if base is None else base)
    bin_dir = str(Path(sys.executable).parent)
    if shutil.which("python3", path=bin_dir) is None:
        raise EmbeddedTritonError(f"no python3 next to {sys.executable}; run from a virtualenv ({INSTALL_HINT})")
    env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in [str(libdir), env.get("LD_LIBRARY_PATH", "")] if p)
    env.pop("PYTHONPATH", None)  # the stub must see the venv, not whatever the caller had
    return env
