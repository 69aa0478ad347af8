"""`make lock`: every install the project makes, locked with hashes, from pyproject.toml alone.

    python requirements/lock.py --uv .cache/tools/uv/bin/uv   # make lock (--upgrade: the newest pins there are)
    python requirements/lock.py --check dev|prod             # make install: exit 1, saying what to do, when
                                                             # pyproject.toml and requirements/ disagree
    python requirements/lock.py --find-python dev|prod       # the Makefile's interpreter for that environment

`uv pip compile --generate-hashes` against PyPI alone, so a laptop's lock and CI's are the same file; shim.txt
first, the others constrained to it (docs/dependencies.md). Standard library only: it runs before any venv.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
LOCK_DIR = ROOT / "requirements"
INPUTS = LOCK_DIR / "inputs.json"
PYPI = "https://pypi.org/simple"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# The dev environment's nvidia-pytriton 0.7.0 pins numpy<2, which has no wheels for Python 3.13.
DEV_PYTHONS = ((3, 11), (3, 12))
# torch's CUDA runtime: PyPI's torch wheels for Linux require these; the CPU builds (WITH_LEGACY=1) do not.
CUDA_NAMES = re.compile(r"^(nvidia-.*|cuda-.*|triton)$")


@dataclass(frozen=True)
class Lock:
    """One requirements/<name>.txt: what it holds, who installs it, and how uv resolves it."""

    name: str
    installed_by: str
    project: bool = True  # [project].dependencies
    build: bool = True  # [build-system].requires: installs build the shim with --no-build-isolation
    extras: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    python: str = "3.11"
    universal: bool = True  # one file for every Python from `python` on and every platform (markers)
    platform: str | None = None
    constrain: tuple[tuple[str, str], ...] = ()  # (lock, which pins): "all", "direct-but-numpy", "groups"
    extra_args: tuple[str, ...] = field(default=())

    @property
    def path(self) -> Path:
        return LOCK_DIR / f"{self.name}.txt"


LOCKS = (
    Lock("shim", "Dockerfile (WITH_LEGACY=0) and wheelhouse/shim: the production shim"),
    Lock("dev", "make install (.venv): make run, make test, make bench",
         extras=("legacy", "local-triton", "dev"), groups=("installer",), constrain=(("shim", "direct-but-numpy"),)),
    Lock("prod-test", "make test-prod (.venv-prod): the production packages, numpy 2, no torch, plus pytest",
         groups=("test-prod", "installer"), constrain=(("shim", "all"), ("dev", "groups"))),
    Lock("shim-legacy", "Dockerfile (WITH_LEGACY=1): the production shim and what torch's CPU build needs, "
         "torch and torchvision themselves in requirements/torch-cpu.txt",
         extras=("legacy",), constrain=(("shim", "all"),)),
    Lock("ci-triton", "docker/ci-triton.Dockerfile and wheelhouse/ci-triton: CI's stand-in Triton image",
         project=False, build=False, groups=("ci-triton",), constrain=(("dev", "all"),)),
    Lock("triton-image", "docker/triton.Dockerfile and wheelhouse/triton: NVIDIA's Triton image (Python 3.10)",
         project=False, build=False, groups=("triton-image",), python="3.10", universal=False,
         platform="x86_64-manylinux_2_35"),
    Lock("uv", "make lock (.cache/tools/uv): this tool's resolver", project=False, build=False, groups=("lock",)),
)
TORCH_CPU = LOCK_DIR / "torch-cpu.txt"


class LockError(Exception):
    """What went wrong and what to do; printed without a traceback."""


def read_pyproject(path: Path = PYPROJECT) -> dict[str, object]:
    try:
        import tomllib
    except ImportError:  # Python < 3.11: python_problem() says so without reading the file
        raise LockError(f"Python {sys.version.split()[0]} is too old for this project: it needs 3.11 or newer "
                        "(set PYTHON, e.g. `make test PYTHON=python3.11`)") from None
    with path.open("rb") as f:
        return tomllib.load(f)


def inputs(pyproject: dict[str, object]) -> dict[str, object]:
    """Everything of pyproject.toml that a lock depends on, and the locks' own recipe."""
    project: dict[str, object] = dict(pyproject.get("project", {}))  # type: ignore[call-overload]
    build: dict[str, object] = dict(pyproject.get("build-system", {}))  # type: ignore[call-overload]
    return {
        "requires-python": project.get("requires-python"),
        "dependencies": project.get("dependencies", []),
        "optional-dependencies": project.get("optional-dependencies", {}),
        "dependency-groups": pyproject.get("dependency-groups", {}),
        "build-system.requires": build.get("requires", []),
        "locks": [repr(lock) for lock in LOCKS],
    }


NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    match = NAME.match(requirement)
    if not match:
        raise LockError(f"cannot read a package name from {requirement!r} in pyproject.toml")
    return canonical(match.group(1))


def differences(old: object, new: object, where: str = "") -> list[str]:
    """Human lines: what changed from `old` to `new` (dicts by key, requirement lists by package)."""
    if isinstance(old, dict) and isinstance(new, dict):
        lines = []
        for key in sorted(set(old) | set(new)):
            lines += differences(old.get(key), new.get(key), f"{where}.{key}" if where else key)
        return lines
    if isinstance(old, list) and isinstance(new, list) and all(isinstance(x, str) for x in old + new):
        if where == "locks":
            return [] if old == new else ["the locks' recipe in requirements/lock.py"]
        gone, added = [x for x in old if x not in new], [x for x in new if x not in old]
        by_name = {requirement_name(x): x for x in gone}
        lines = []
        for x in added:
            before = by_name.pop(requirement_name(x), None)
            lines.append(f"{where}: {before!r} -> {x!r}" if before else f"{where}: added {x!r}")
        lines += [f"{where}: removed {x!r}" for x in by_name.values()]
        return lines
    return [] if old == new else [f"{where}: {old!r} -> {new!r}"]


@dataclass(frozen=True)
class Pin:
    name: str
    line: str  # "name==version ; marker", no hashes
    via: frozenset[str]


def read_pins(path: Path) -> list[Pin]:
    """The pins of a requirements file uv wrote: requirement lines, and the `# via` annotations below each."""
    found: list[tuple[str, str, set[str]]] = []
    in_via = False
    for raw in path.read_text().splitlines():
        text = raw.strip()
        if raw and not raw[0].isspace() and not raw.startswith(("#", "-")):
            line = raw.rstrip(" \\")
            found.append((requirement_name(line), line, set()))
        if not (found and raw[:1].isspace() and text.startswith("#")):
            in_via = False  # a pin, its hashes, a blank line or a comment of the file's own
            continue
        if text.startswith("# via"):
            in_via, text = True, text[len("# via"):]
        text = text.lstrip("#").strip()
        if in_via and text and not text.startswith("-"):  # -r, -c: a requirements or constraints file
            found[-1][2].add("(project)" if "pyproject.toml" in text else requirement_name(text))
    return [Pin(name, line, frozenset(via)) for name, line, via in found]


def cuda_only(pins: Iterable[Pin]) -> set[str]:
    """torch's nvidia-*/cuda-*/triton dependencies, and whatever only they need."""
    pins = list(pins)
    cuda = {p.name for p in pins if "torch" in p.via and CUDA_NAMES.match(p.name)}
    grew = True
    while grew:
        more = {p.name for p in pins if p.name not in cuda and p.via and p.via <= cuda}
        cuda |= more
        grew = bool(more)
    return cuda


def constraints(lock: Lock, pyproject: dict[str, object]) -> list[str]:
    lines: list[str] = []
    project: dict[str, list[str]] = pyproject["project"]  # type: ignore[assignment]
    groups: dict[str, list[str]] = pyproject.get("dependency-groups", {})  # type: ignore[assignment]
    for source, which in lock.constrain:
        pins = read_pins(LOCK_DIR / f"{source}.txt")
        if which == "all":
            names = {pin.name for pin in pins}
        elif which == "direct-but-numpy":
            names = {requirement_name(r) for r in project["dependencies"]} - {"numpy"}
        elif which == "groups":
            names = {requirement_name(r) for g in lock.groups for r in groups.get(g, []) if isinstance(r, str)}
        else:
            raise ValueError(which)
        lines += [pin.line for pin in pins if pin.name in names]
    return lines


def header(lock_path: Path, installed_by: str, uv_version: str) -> str:
    return (f"# {lock_path.relative_to(ROOT)}: {installed_by}.\n"
            f"# Made by `make lock` (requirements/lock.py, {uv_version}) from pyproject.toml: never edit it by hand.\n")


def scratch(path: Path, lines: Iterable[str]) -> str:
    """A file of `lines` for uv to read; its path."""
    path.write_text("".join(f"{line}\n" for line in lines))
    return str(path)


def write_if_changed(path: Path, text: str) -> bool:
    if path.is_file() and path.read_text() == text:
        return False
    path.write_text(text)
    return True


class Uv:
    def __init__(self, binary: str) -> None:
        self.binary = binary
        # uv's own configuration and UV_* settings could point it at another index: none of it applies.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("UV_") or k == "UV_CACHE_DIR"}
        self.env["UV_PYTHON_DOWNLOADS"] = "never"  # a target Python that is not here must not be downloaded
        self.version = " ".join(self.run(["--version"]).stdout.split()[:2])  # "uv 0.13.9", not its platform

    def run(self, args: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([self.binary, *args], cwd=ROOT, env=self.env, capture_output=True, text=True,
                                check=False)
        if check and result.returncode != 0:
            raise LockError(f"`uv {' '.join(args[:4])} ...` failed:\n{result.stderr.strip()[-4000:]}")
        return result

    def compile(self, sources: list[str], out: Path, *, python: str, universal: bool, platform: str | None,
                extra: Iterable[str] = (), check: bool = True) -> subprocess.CompletedProcess[str]:
        args = ["pip", "compile", *sources, "--output-file", str(out), "--no-header", "--no-config",
                "--python", sys.executable, "--python-version", python, "--quiet", *extra, "--generate-hashes"]
        if universal:
            # One version for every Python where one serves all: make test-prod on 3.13 tests the 3.11 image's.
            args += ["--universal", "--fork-strategy", "fewest"]
        if platform:
            args += ["--python-platform", platform]
        return self.run(args, check=check)


def compile_lock(uv: Uv, lock: Lock, pyproject: dict[str, object], work: Path, *, upgrade: bool) -> str:
    sources: list[str] = []
    if lock.project:
        sources.append("pyproject.toml")
        sources += [a for extra in lock.extras for a in ("--extra", extra)]
    sources += [a for group in lock.groups for a in ("--group", group)]
    extra = ["--index-url", PYPI, *lock.extra_args]
    if lock.build:
        sources.append(scratch(work / f"{lock.name}.build.in", pyproject["build-system"]["requires"]))  # type: ignore[index]
    if lock.constrain:
        extra += ["--constraints", scratch(work / f"{lock.name}.constraints.txt", constraints(lock, pyproject))]
    if lock.name == "shim-legacy":
        # PyPI's torch is the CUDA build: its runtime left out, torch itself from the CPU index (torch-cpu.txt).
        excludes = scratch(work / "cuda.txt", sorted(cuda_only(read_pins(LOCK_DIR / "dev.txt"))))
        extra += ["--excludes", excludes, "--no-emit-package", "torch", "--no-emit-package", "torchvision"]
    out = work / f"{lock.name}.txt"
    if lock.path.is_file() and not upgrade:  # uv keeps the pins of the file it writes, where they still fit
        out.write_text(lock.path.read_text())
    uv.compile(sources, out, python=lock.python, universal=lock.universal, platform=lock.platform, extra=extra)
    text = out.read_text()
    # The annotations name the scratch files: name what they stand for, so the file is the same anywhere.
    text = text.replace(f"-r {work / f'{lock.name}.build.in'}", "pyproject.toml [build-system]")
    sources_of = " ".join(f"requirements/{source}.txt" for source, _ in lock.constrain)
    text = text.replace(f"-c {work / f'{lock.name}.constraints.txt'}", f"-c {sources_of}")
    text = text.replace(f"-r {work / 'cuda.txt'}", "torch's CUDA runtime, left out")
    if str(work) in text:
        raise LockError(f"uv's output for {lock.name} names a scratch file: {text[text.index(str(work)):][:200]}")
    return header(lock.path, lock.installed_by, uv.version) + text


def torch_cpu_lock(uv: Uv, pyproject: dict[str, object], work: Path) -> tuple[str, str | None]:
    """torch-cpu.txt's text (the `legacy` extra's pins as CPU builds) and, when the CPU index could not hash it, why."""
    legacy: list[str] = pyproject["project"]["optional-dependencies"]["legacy"]  # type: ignore[index]
    pins = []
    for requirement in legacy:
        match = re.fullmatch(r"\s*([A-Za-z0-9._-]+)\s*==\s*([0-9][0-9a-z.]*)\s*", requirement)
        if not match:
            raise LockError(f"the legacy extra must pin each package exactly (torch==X.Y.Z), not {requirement!r}")
        pins.append(f"{match.group(1)}=={match.group(2)}+cpu")
    source = scratch(work / "torch-cpu.in", pins)
    out = work / "torch-cpu.txt"
    installed_by = ("Dockerfile (WITH_LEGACY=1), with --no-deps from " + TORCH_CPU_INDEX
                    + ": torch and torchvision as CPU builds (their dependencies: requirements/shim-legacy.txt)")
    result = uv.compile([source], out, python="3.11", universal=False, platform="x86_64-manylinux_2_28",
                        extra=["--index-url", TORCH_CPU_INDEX, "--no-deps"], check=False)
    if result.returncode == 0:
        return header(TORCH_CPU, installed_by, uv.version) + out.read_text(), None
    why = (result.stderr.strip().splitlines() or ["no error text"])[-1].strip().removeprefix("cause: ")
    if TORCH_CPU.is_file() and "--hash=" in TORCH_CPU.read_text() and all(p in TORCH_CPU.read_text() for p in pins):
        return TORCH_CPU.read_text(), f"{TORCH_CPU_INDEX} did not answer ({why}): kept the hashed file as it was"
    text = (header(TORCH_CPU, installed_by, uv.version)
            + f"# NOT HASHED: `make lock` could not reach {TORCH_CPU_INDEX} ({why}).\n"
            + "# Run `make lock` where it answers: pip then checks these two wheels' hashes too.\n"
            + "".join(f"{p}\n" for p in pins))
    return text, f"{TORCH_CPU_INDEX} did not answer ({why}): torch-cpu.txt pins versions without hashes"


def lock_all(uv_binary: str, *, upgrade: bool = False) -> int:
    uv = Uv(uv_binary)
    pyproject = read_pyproject()
    with tempfile.TemporaryDirectory(prefix="lock-") as tmp:
        work = Path(tmp)
        for lock in LOCKS:
            text = compile_lock(uv, lock, pyproject, work, upgrade=upgrade)
            changed = write_if_changed(lock.path, text)
            print(f"lock: {lock.path.relative_to(ROOT)} {'written' if changed else 'unchanged'} "
                  f"({len(read_pins(lock.path))} packages)", flush=True)
            if lock.name == "shim":
                numpy = [p.line for p in read_pins(lock.path) if p.name == "numpy"]
                print(f"lock:   the production shim's numpy: {', '.join(numpy)}", flush=True)
        text, warning = torch_cpu_lock(uv, pyproject, work)
        changed = write_if_changed(TORCH_CPU, text)
        print(f"lock: {TORCH_CPU.relative_to(ROOT)} {'written' if changed else 'unchanged'}", flush=True)
    write_if_changed(INPUTS, json.dumps(inputs(pyproject), indent=2, sort_keys=True) + "\n")
    if warning:
        print(f"lock: WARNING: {warning}", file=sys.stderr)
    print("lock: done; commit requirements/ with pyproject.toml", flush=True)
    return 0


def python_problem(env: str, pyproject: dict[str, object], version: tuple[int, int] | None = None) -> str | None:
    """Why this Python cannot run `env` (dev: make run / make test; prod: the shim alone), or None."""
    version = version or (sys.version_info.major, sys.version_info.minor)
    spec = str(pyproject["project"].get("requires-python", ""))  # type: ignore[attr-defined]
    low = re.search(r">=\s*3\.(\d+)", spec)
    high = re.search(r"<\s*3\.(\d+)", spec)
    if not (low and high):
        raise LockError(f"requires-python must read '>=3.X,<3.Y' (requirements/lock.py reads it), not {spec!r}")
    allowed = [(3, minor) for minor in range(int(low.group(1)), int(high.group(1)))]
    if env == "dev":
        allowed = [v for v in allowed if v in DEV_PYTHONS]
    if version in allowed:
        return None
    names = " or ".join(f"{a}.{b}" for a, b in allowed)
    found = ".".join(map(str, version))
    why = ""
    if env == "dev" and version >= (3, 13):
        why = (" (the local Triton, nvidia-pytriton 0.7.0, pins numpy<2, which has no wheels for Python 3.13;"
               " the shim alone runs on it: make test-prod)")
    elif version < (3, 11):
        why = " (the shim uses 3.11's standard library: tomllib, typing.Self, ...)"
    return (f"Python {found} cannot run this environment: it needs Python {names}{why}. "
            f"Set PYTHON, e.g. `make {'test' if env == 'dev' else 'test-prod'} "
            f"PYTHON=python{allowed[0][0]}.{allowed[0][1]}`")


def check(env: str) -> int:
    pyproject = read_pyproject()
    missing = [str(p.relative_to(ROOT)) for p in [INPUTS, TORCH_CPU, *(lock.path for lock in LOCKS)] if not p.is_file()]
    problem = python_problem(env, pyproject) or (f"missing {', '.join(missing)}: run `make lock`" if missing else None)
    changed = [] if problem else differences(json.loads(INPUTS.read_text()), inputs(pyproject))
    if changed:
        problem = ("pyproject.toml and the lock files in requirements/ disagree; what changed since `make lock` last "
                   "ran:\n" + "".join(f"  - {line}\n" for line in changed)
                   + "Run `make lock` (it rewrites requirements/ from pyproject.toml) and commit both.")
    if problem:
        print(f"install: {problem}", file=sys.stderr)
    return 1 if problem else 0


def find_python(env: str) -> str:
    """An interpreter that can run `env`: for dev, python3 when it can, else the oldest supported one found;
    for prod, the newest (it proves the shim on another Python than the dev one). PATH first, then pyenv's
    versions (installed there, but maybe not selected, so that `python3.13` is not runnable)."""
    pyproject = read_pyproject()
    versions = [v for v in [(3, m) for m in range(8, 20)] if python_problem(env, pyproject, v) is None]
    if env == "prod":
        versions = versions[::-1]
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = ["python3"] if env == "dev" else []
    for a, b in versions:
        installed = sorted(pyenv.glob(f"{a}.{b}.*/bin/python{a}.{b}"),
                           key=lambda p: [int(x) if x.isdigit() else 0 for x in p.parts[-3].split(".")])
        candidates += [f"python{a}.{b}", *map(str, installed[-1:])]
    for candidate in candidates:
        try:
            result = subprocess.run([candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                    capture_output=True, text=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if result.returncode == 0 and tuple(map(int, result.stdout.split("."))) in versions:
            return candidate
    raise LockError(f"no Python {' or '.join(f'{a}.{b}' for a, b in versions)} found (PATH, pyenv)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="requirements/lock.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--uv", help="the uv binary (make lock installs it into .cache/tools/uv)")
    parser.add_argument("--check", choices=["dev", "prod"],
                        help="check, write nothing: the locks match pyproject.toml and this Python runs the env")
    parser.add_argument("--upgrade", action="store_true",
                        help="every package at the newest release its bounds allow (default: keep the locked pins "
                             "that still fit, move only what a changed bound or a new requirement forces)")
    parser.add_argument("--find-python", choices=["dev", "prod"], help="print an interpreter for the env")
    args = parser.parse_args(argv)
    try:
        if args.find_python:
            print(find_python(args.find_python))
            return 0
        if args.check:
            return check(args.check)
        if not args.uv:
            parser.error("--uv is required to lock")
        return lock_all(args.uv, upgrade=args.upgrade)
    except LockError as e:
        print(f"{'install' if args.check else 'lock'}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
