"""Fixtures: a test copy of triton_repo with a small seeded model, and a real Triton serving it.

Tests under tests/unit/ run in-process (fakes at the Backend seam, Flask's test client) and must not ask
for a fixture that starts a server; tests under tests/integration/ start the real Triton and gunicorn.
Each gets its marker from its folder: `pytest -m unit` runs in seconds, `make test` runs both.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import pytest

from devstack import launch
from devstack.launch import ServedApp
from tests.support import ROOT, TRITON_REPO, free_ports

if TYPE_CHECKING:  # imported where a server starts: `make test-prod` runs without the local Triton's packages
    from devstack import EmbeddedTriton

TEST_ARCH = "resnet18"  # same input and output shapes as resnet50, a third of the compute
# Two more classifiers, each with its own preprocessing, labels and legacy transform (examples/transforms.py),
# served by the session's Triton beside resnet50: their descriptions are examples/models/<name>/model.toml.
OWN_MODELS = ("efficientnet_lite0", "mobilenet_v3_small")
# The own model whose encoded transport the session's Triton serves too (efficientnet_lite0_decode and _encoded:
# the agreement gate's step and tests/integration/test_own_models.py's encoded answers); the other's decode step
# is generated but left out, one torch stub fewer to start (its resize is tests/unit/test_decode_step.py's).
ENCODED_OWN_MODELS = ("efficientnet_lite0",)
SERVER_FIXTURES = {"triton", "triton_client", "shim_triton", "shim_legacy", "legacy_app", "switchable"}


_STOPPING: list[threading.Thread] = []


def stop_soon(server: ServedApp | EmbeddedTriton) -> None:
    """Stop a server the tests are done with, quickly and in the background: a gunicorn with torch loaded
    takes a second or two to exit, and the next tests need not wait for it. The session's end waits."""
    thread = threading.Thread(target=server.stop, kwargs={"graceful": False}, name="stop-soon")
    thread.start()
    _STOPPING.append(thread)


class Killable(Protocol):
    def kill(self) -> None: ...


K = TypeVar("K", bound=Killable)
_EARLY_STARTS: dict[str, Callable[[], Killable]] = {}
_EARLY_STARTED: dict[str, Killable] = {}


def start_early(fixture: str, start: Callable[[], Killable]) -> None:
    """Have `start` (which launches a server or subprocess and returns at once) called when collection ends,
    if a selected test uses `fixture`: it then starts beside the in-process unit tests (which run first and
    keep only one of the two cores busy). The fixture gets it with take_early."""
    _EARLY_STARTS[fixture] = start


def take_early(fixture: str, start: Callable[[], K]) -> K:
    """What start_early launched for `fixture` (once), else `start()` now."""
    started: Any = _EARLY_STARTED.pop(fixture, None)
    return started if started is not None else start()


# `make test-prod` runs pytest in .venv-prod, with the production packages alone (no torch, no Triton, no dev
# tools): there only the modules that mention the `prod` marker are collected (others import dev packages at
# the top), and `-m prod` picks the marked tests from them.
PRODUCTION_ENV = os.environ.get("TESTS_ENV") == "production"


def _mentions_prod(test_module: Path) -> bool:
    return "pytest.mark.prod" in test_module.read_text()


def pytest_ignore_collect(collection_path: Path) -> bool | None:
    if not PRODUCTION_ENV:  # tests/prod/ compares .venv-prod with .venv: only make test-prod runs it
        return True if collection_path == Path(__file__).parent / "prod" else None
    if collection_path.is_dir():  # a folder with no such module: not even its conftest.py is imported
        return not any(_mentions_prod(module) for module in collection_path.rglob("test_*.py"))
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return not _mentions_prod(collection_path)
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        starts_server = bool(SERVER_FIXTURES & set(getattr(item, "fixturenames", ())))
        if "unit" in item.path.parts and starts_server:
            raise pytest.UsageError(f"{item.nodeid} is a unit test but asks for a server: move it to tests/integration")
        marked = item.get_closest_marker("integration") or item.get_closest_marker("triton")
        item.add_marker("integration" if "integration" in item.path.parts or starts_server or marked else "unit")
    items.sort(key=lambda item: "unit" not in item.path.parts)  # stable: the unit tests first, in their order


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    used = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    for fixture, start in _EARLY_STARTS.items():
        if fixture in used:
            _EARLY_STARTED[fixture] = start()


_SUMMARY: list[str] = []  # what the end of the run must say though every test passed


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for line in _SUMMARY:
        terminalreporter.write_line(f"NOTE: {line}", yellow=True, bold=True)


def pytest_sessionfinish() -> None:
    for thread in _STOPPING:
        thread.join(timeout=120)
    for leftover in _EARLY_STARTED.values():  # started, but its test never ran (it failed earlier, or -x)
        leftover.kill()
    if _session_dir.cache_info().currsize:  # made by this session
        shutil.rmtree(_session_dir(), ignore_errors=True)


def export_test_model(seed: int = 0) -> Path:
    """A seeded resnet18 TorchScript file, exported once and reused by later runs."""
    from modelrepo.export import build_model, read_export_info, save_torchscript

    target = ROOT / ".cache" / "test-models" / f"{TEST_ARCH}-seed{seed}.pt"
    info = read_export_info(target) or {}
    if (info.get("arch"), info.get("seed")) != (TEST_ARCH, seed):
        save_torchscript(build_model(TEST_ARCH, None, seed), target, {"arch": TEST_ARCH, "seed": seed})
    return target


@pytest.fixture(scope="session")
def test_model_pt() -> Path:
    return export_test_model(seed=0)


@pytest.fixture(scope="session")
def seed1_model_pt() -> Path:
    """Other weights for the same architecture: a second version that answers differently."""
    return export_test_model(seed=1)


def normalize_model_pt() -> Path:
    """The uint8 transport's `normalize` TorchScript, exported once and reused by later runs."""
    from modelrepo.export import NORMALIZE_INFO, build_normalize, read_export_info, save_torchscript

    target = ROOT / ".cache" / "test-models" / "normalize.pt"
    info = read_export_info(target) or {}
    if any(info.get(k) != v for k, v in NORMALIZE_INFO.items()):
        save_torchscript(build_normalize(), target, NORMALIZE_INFO)
    return target


def make_test_repo(dest: Path, model_pt: Path, *, only_resnet50: bool = False) -> Path:
    """triton_repo as committed (configs, preprocess model.py), with `model_pt` as resnet50 version 1.
    `only_resnet50`: that model alone, for tests that send it tensors (a server with one torch stub fewer
    and no preprocess starts in about half the time)."""
    from modelrepo.export import write_labels

    shutil.copytree(TRITON_REPO, dest, ignore=shutil.ignore_patterns("model.pt", "labels.txt", "__pycache__"))
    if only_resnet50:
        for other in {p.name for p in dest.iterdir() if p.is_dir()} - {"resnet50"}:
            shutil.rmtree(dest / other)
    write_labels(TEST_ARCH, dest / "resnet50" / "labels.txt")
    (dest / "resnet50" / "1").mkdir(exist_ok=True)
    (dest / "resnet50" / "1" / "model.pt").symlink_to(model_pt)
    if not only_resnet50:
        (dest / "normalize" / "1").mkdir(exist_ok=True)
        (dest / "normalize" / "1" / "model.pt").symlink_to(normalize_model_pt())
    return dest


def export_own_models() -> Path:
    """OWN_MODELS exported by modelrepo/export.py into .cache/test-models/repo once (kept while current): the
    repository bench/agreement.py's reference model (EfficientNet-Lite0) comes from too."""
    from bench.reference_model import REPO, export_example

    for name in OWN_MODELS:
        export_example(name, REPO)
    return REPO


def add_own_models(dest: Path) -> None:
    """The own models' folders (their uint8 ensembles and normalize steps, and ENCODED_OWN_MODELS' decode steps and
    encoded ensembles) into a test repository; the shared `normalize` step is the repository's own."""
    cache = export_own_models()
    left_out = {f"{name}_{suffix}" for name in set(OWN_MODELS) - set(ENCODED_OWN_MODELS)
                for suffix in ("decode", "encoded")}
    for folder in sorted(cache.iterdir()):
        if folder.name not in left_out | {"normalize"} and folder.name.startswith(OWN_MODELS):
            shutil.copytree(folder, dest / folder.name, symlinks=True,
                            ignore=shutil.ignore_patterns("model.pt", "__pycache__"))
            for model_pt in folder.glob("[0-9]*/model.pt"):
                (dest / folder.name / model_pt.parent.name / "model.pt").symlink_to(model_pt)


def start_triton(repo: Path, cache_dir: Path, *, ports: list[int] | None = None,
                 admin_key: str = "") -> EmbeddedTriton:
    """`admin_key`: Triton's model-repository and shared-memory APIs need it, as `make run` starts Triton."""
    from devstack import EmbeddedTriton, EmbeddedTritonConfig

    http, grpc, metrics = ports or free_ports(3)
    config = EmbeddedTritonConfig(model_repository=repo, cache_dir=cache_dir, http_port=http,
                                  grpc_port=grpc, metrics_port=metrics, startup_timeout_s=240, admin_key=admin_key)
    return EmbeddedTriton(config).start()


@functools.cache
def _session_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="shim-tests-"))


@functools.cache
def session_test_repo() -> Path:
    """The session's copy of triton_repo with the seeded model, made once (on the main thread: exporting
    runs torch, which must never run in two threads at once; seen: kernels registered twice, a segfault)."""
    repo = make_test_repo(_session_dir() / "triton_repo", export_test_model())
    add_own_models(repo)
    return repo


class SessionTriton:
    """The session's Triton on session_test_repo(), started in a thread: it boots (a torch stub per model,
    about 10 s here) while this thread goes on."""

    def __init__(self) -> None:
        repo = session_test_repo()
        # Picked here, not in the thread: a socket that free_ports binds for an instant is inherited by any
        # process another thread forks at that instant, and stays bound until that child execs. A second set
        # for a second try.
        ports = free_ports(6)
        self._server: Future[EmbeddedTriton] = Future()
        threading.Thread(target=self._boot, args=(repo, ports), name="session-triton", daemon=True).start()

    def _boot(self, repo: Path, ports: list[int]) -> None:
        from devstack.errors import EmbeddedTritonError

        try:
            try:
                server = start_triton(repo, _session_dir() / "triton-cache", ports=ports[:3])
            except EmbeddedTritonError as first:
                # One more try, or every test that needs Triton fails with it. Seen once, in a CI run on another
                # machine: 'exited during start-up', nothing in its log. A second failure shows both.
                server = start_triton(repo, _session_dir() / "triton-cache-2", ports=ports[3:])
                _SUMMARY.append(f"the session's Triton started at the second try; the first: {first}")
            self._server.set_result(server)
        except BaseException as e:  # raised again in the test that asks for it
            self._server.set_exception(e)

    def server(self) -> EmbeddedTriton:
        return self._server.result(timeout=600)

    def kill(self) -> None:
        if self._server.done() and self._server.exception() is None:
            self._server.result().stop(graceful=False)


start_early("triton", SessionTriton)


@pytest.fixture(scope="session")
def test_repo() -> Path:
    return session_test_repo()


@pytest.fixture(scope="session")
def triton() -> Iterator[EmbeddedTriton]:
    """One real Triton for the session. Tests must not change its repository: see hot-reload tests."""
    server = take_early("triton", SessionTriton).server()
    yield server
    stop_soon(server)


@pytest.fixture
def triton_client(triton: EmbeddedTriton) -> Iterator[object]:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(triton.http_url, network_timeout=60)
    yield client
    client.close()


@pytest.fixture(scope="session")
def reference_model(test_model_pt: Path) -> object:
    """The same TorchScript file, called in-process: what Triton's answers must equal."""
    import torch

    return torch.jit.load(str(test_model_pt), map_location="cpu").eval()


def start_shim(tmp: Path, *, triton_url: str, repo: Path, model_pt: Path, **settings: object) -> ServedApp:
    """The shim under gunicorn, as `make run` starts it (2 workers, its default threads) unless told otherwise.
    `repo`'s model.toml names the labels and the legacy model (`model_pt` in make_test_repo's repositories)."""
    env = {"SHIM_TRITON_URL": triton_url, "SHIM_MODEL_REPOSITORY": str(repo), "SHIM_WORKERS": "2",
           "SHIM_TRITON_TIMEOUT_S": "10"}
    env.update({f"SHIM_{k.upper()}": str(v) for k, v in settings.items()})
    return launch.start_shim(tmp, env)


def shim_traffic(flag_file: Path, repo: Path, *args: str, model_name: str = "resnet50") -> str:
    """The shim-traffic command, run as an operator runs it beside a shim with this flag file; its output."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SHIM_FLAG_FILE": str(flag_file),
           "SHIM_MODEL_REPOSITORY": str(repo), "SHIM_MODEL_NAME": model_name}
    done = subprocess.run([sys.executable, "-c", "from app.traffic import main; raise SystemExit(main())", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def start_legacy_app(tmp: Path, *, repo: Path, model_pt: Path) -> ServedApp:
    return launch.start_legacy_app(tmp, model_pt=model_pt, labels=repo / "resnet50" / "labels.txt")


@pytest.fixture(scope="session")
def shim_triton(triton: EmbeddedTriton, test_repo: Path, test_model_pt: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedApp]:
    """The shim in triton mode (2 workers x 8 threads) against the session's Triton."""
    served = start_shim(tmp_path_factory.mktemp("shim-triton"), triton_url=triton.http_url, repo=test_repo,
                        model_pt=test_model_pt, mode="triton")
    yield served.wait("/readyz")
    stop_soon(served)


@pytest.fixture(scope="session")
def shim_legacy(triton: EmbeddedTriton, test_repo: Path, test_model_pt: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedApp]:
    """The shim in legacy mode: the in-process PyTorch backend."""
    served = start_shim(tmp_path_factory.mktemp("shim-legacy"), triton_url=triton.http_url, repo=test_repo,
                        model_pt=test_model_pt, mode="legacy", workers=1)
    yield served.wait("/readyz")
    stop_soon(served)


@pytest.fixture(scope="session")
def legacy_app(test_repo: Path, test_model_pt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedApp]:
    served = start_legacy_app(tmp_path_factory.mktemp("legacy-app"), repo=test_repo, model_pt=test_model_pt)
    yield served.wait("/", status=404)  # it has no health endpoint: any contract answer means it is up
    stop_soon(served)
