"""`make compose-test`: build the images and run docker-compose.yml for real, then check it as a user would.

    .venv/bin/python tests/compose/driver.py

Runs on a machine with no GPU and no container registry (CI). Stages, one line each with its duration:

  ports       the host ports the stack publishes (5000, 9090) are free, and Triton's (8000-8002), which it
              must not publish: tests/compose checks that nothing answers there
  tools       a docker engine, Compose v2 and buildx, debootstrap: installed with apt when missing
              (Compose v2 and buildx as Debian trixie's packages: bookworm ships Compose v1 only)
  engine      a running dockerd: the one there is, or one started here and stopped at the end, pass or fail
  base image  flask-triton-shim-ci/python:3.11-bookworm, standing in for python:3.11-slim-bookworm:
              debootstrap (minbase) from the machine's own Debian mirror, imported; cached as a tarball
  stand-in    modelrepo/standin.py's numpy copy of triton_repo (no torch in the CI Triton image)
  wheelhouses wheelhouse/shim and wheelhouse/ci-triton: `pip download` of requirements/shim.txt and
              requirements/ci-triton.txt (hash-checked), so the builds need no network
  prometheus  Debian's prometheus package, for the monitoring profile's image
  proxy       Debian's nginx and gettext-base packages and the entrypoint stand-in, for the proxy's image
  build       `docker compose build`: the real Dockerfile and the CI images of tests/compose/ci.yml
  stack       pytest tests/compose: `up --wait`, every assertion, `down -v`
  cleanup     `down -v` again (a no-op after a pass), the engine stopped if started here, leftovers checked

Expensive things are cached under .cache/compose/ and wheelhouse/ (both ignored by git), images stay in
the engine's store: a second run skips them. `make clean` removes .cache (not the images).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "compose"
LOGS = CACHE / "logs"
COMPOSE_FILES = (ROOT / "docker-compose.yml", ROOT / "tests" / "compose" / "ci.yml")
PROJECT = "flask-triton-shim-ci"  # tests/compose/ci.yml's `name:`: never a real deployment's project
PROFILES = ("monitoring",)
# Services of those profiles that CI cannot run, and why (everything else in docker-compose.yml runs).
NOT_IN_CI = {"grafana": "grafana/grafana cannot be pulled here and Debian has no grafana package"}
HOST_PORTS = (5000, 8000, 8001, 8002, 9090)  # published: 5000 (nginx), 9090 (Prometheus); 8000-8002 must stay closed

SUITE = "bookworm"  # python:3.11-slim-bookworm's Debian release: Python 3.11
BASE_IMAGE = "flask-triton-shim-ci/python:3.11-bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates",
                 "libpython3.11")  # the python backend's stub links libpython (python:3.11-slim has it too)
WHEELHOUSE = ROOT / "wheelhouse"
SHIM_WHEELHOUSE = WHEELHOUSE / "shim"
TRITON_WHEELHOUSE = WHEELHOUSE / "ci-triton"
SHIM_LOCK = ROOT / "requirements" / "shim.txt"  # `make lock`: the Dockerfile installs exactly these
TRITON_LOCK = ROOT / "requirements" / "ci-triton.txt"  # and docker/ci-triton.Dockerfile these
STANDIN_REPO = CACHE / "standin-repo"
PROMETHEUS_CONTEXT = CACHE / "prometheus"
PROXY_CONTEXT = CACHE / "proxy"
PROXY_PACKAGES = ("nginx", "gettext-base")  # the nginx binary and envsubst, as in the official image
PROXY_ENTRYPOINT = ROOT / "docker" / "proxy-entrypoint.sh"
MIN_COMPOSE = (2, 24)  # `!reset` in override files


class StageError(Exception):
    """A stage failed; the message says what to do."""


def run(cmd: list[str | Path], *, log: Path | None = None, timeout: float = 600, check: bool = True,
        env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run a command; its output goes to `log` (appended) or is captured. A failure raises StageError."""
    args = [str(c) for c in cmd]
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as out:
            out.write(f"\n$ {' '.join(args)}\n")
            out.flush()
            result = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                                    env=env, cwd=cwd, check=False)
        output = ""
    else:
        result = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd,
                                check=False)
        output = (result.stdout + result.stderr).strip()
    if check and result.returncode != 0:
        tail = output or (log.read_text()[-3000:] if log else "")
        where = f" (log: {log.relative_to(ROOT)})" if log else ""
        raise StageError(f"`{' '.join(args[:6])}{' ...' if len(args) > 6 else ''}` failed with exit code "
                         f"{result.returncode}{where}:\n{tail[-3000:]}")
    return result


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run(["docker", *args], timeout=timeout, check=check)


# --- the stack, as tests/compose/ sees it ---------------------------------------------------------------

def compose_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment less what would change the stack under test (SHIM_*, COMPOSE_*), plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SHIM_", "COMPOSE_", "GRAFANA_", "DOCKER_HOST"))}
    env["DOCKER_BUILDKIT"] = "1"
    return {**env, **(extra or {})}


@dataclass
class Stack:
    """docker-compose.yml with the CI override, as one compose project."""

    env: dict[str, str] = field(default_factory=dict)  # e.g. SHIM_ADMIN_TOKEN, interpolated by compose

    def compose(self, *args: str, timeout: float = 300, check: bool = True,
                log: Path | None = None) -> subprocess.CompletedProcess[str]:
        files = [a for f in COMPOSE_FILES for a in ("-f", str(f))]
        profiles = [a for p in PROFILES for a in ("--profile", p)]
        # --env-file /dev/null: a developer's ./.env must not change what CI runs.
        return run(["docker", "compose", "--env-file", "/dev/null", *files, *profiles, *args],
                   timeout=timeout, check=check, env=compose_env(self.env), log=log)

    def config(self) -> dict[str, Any]:
        merged: dict[str, Any] = json.loads(self.compose("config", "--format", "json").stdout)
        return merged

    def services(self) -> list[str]:
        """Every service of the default set and the CI profiles, less NOT_IN_CI."""
        return [name for name in self.config()["services"] if name not in NOT_IN_CI]

    def buildable(self) -> list[str]:
        config = self.config()["services"]
        return [name for name in self.services() if "build" in config[name]]

    def build(self, only: list[str] | None = None) -> list[str]:
        """Build every buildable service, or those of `only` (make k8s-test builds the images it plays)."""
        built = [name for name in self.buildable() if only is None or name in only]
        self.compose("build", *built, timeout=1200, log=LOGS / "build.log")
        services = self.config()["services"]
        missing = {name: services[name].get("image", "?") for name in (only or self.services())
                   if not image_exists(services[name].get("image", ""))}
        if missing:  # `up --pull never` would fail on them with less to go on
            raise StageError(f"no image for {missing}: nothing can be pulled here. Give each a local build in "
                             "tests/compose/ci.yml, or list it in NOT_IN_CI (tests/compose/driver.py) with the reason")
        return built

    def up(self) -> None:
        """Start and wait until every service is running, and healthy where it has a healthcheck."""
        self.compose("up", "--detach", "--wait", "--pull", "never", "--no-build", *self.services(), timeout=600,
                     log=LOGS / "up.log")

    def down(self) -> None:
        """Save every service's log, then remove the project's containers, networks and volumes."""
        if not self.leftovers()["containers"]:
            self.compose("down", "--volumes", "--remove-orphans", timeout=120, check=False, log=LOGS / "down.log")
            return
        LOGS.mkdir(parents=True, exist_ok=True)
        (LOGS / "stack.log").write_text(self.compose("logs", "--no-color", "--timestamps", check=False,
                                                     timeout=60).stdout)
        self.compose("down", "--volumes", "--remove-orphans", "--timeout", "20", timeout=180,
                     log=LOGS / "down.log")

    def container_id(self, service: str) -> str:
        ids = self.compose("ps", "--all", "--quiet", service).stdout.split()
        if len(ids) != 1:
            raise AssertionError(f"expected one container of {service}, found {ids}")
        return ids[0]

    def inspect(self, service: str) -> dict[str, Any]:
        data: list[dict[str, Any]] = json.loads(docker("inspect", self.container_id(service)).stdout)
        return data[0]

    def health(self, service: str) -> str:
        state = self.inspect(service)["State"]
        return str(state.get("Health", {}).get("Status", state["Status"]))

    def wait_healthy(self, service: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while (status := self.health(service)) != "healthy":
            if time.monotonic() > deadline:
                raise AssertionError(f"{service} is {status}, not healthy, after {timeout_s:.0f} s")
            time.sleep(1)

    def exec(self, service: str, *cmd: str) -> str:
        return self.compose("exec", "-T", service, *cmd, timeout=60).stdout

    @staticmethod
    def leftovers() -> dict[str, list[str]]:
        """The project's containers, networks and volumes that exist now (by compose's own labels)."""
        label = f"label=com.docker.compose.project={PROJECT}"
        return {
            "containers": docker("ps", "--all", "--quiet", "--filter", label).stdout.split(),
            "networks": docker("network", "ls", "--quiet", "--filter", label).stdout.split(),
            "volumes": docker("volume", "ls", "--quiet", "--filter", label).stdout.split(),
        }


def busy_ports() -> list[int]:
    busy = []
    for port in HOST_PORTS:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                busy.append(port)
    return busy


def check_ports() -> str:
    busy = busy_ports()
    if busy:
        raise StageError(f"host port(s) {', '.join(map(str, busy))} are in use; the stack publishes "
                         f"{', '.join(map(str, HOST_PORTS))}. Stop what listens there (`ss -ltnp`: `make run`, "
                         "`make triton` or a stack left by hand: `docker compose -f docker-compose.yml -f "
                         "tests/compose/ci.yml down -v`) and run again")
    return "free: " + ", ".join(map(str, HOST_PORTS))


# --- tools ----------------------------------------------------------------------------------------------

def is_root() -> bool:
    return os.geteuid() == 0


def debian_mirror() -> str:
    """The Debian mirror this machine's apt uses (deb822 .sources files or sources.list lines)."""
    texts = [p.read_text() for p in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
             if p.is_file()]
    for text in texts:
        for uri, suites in re.findall(r"^URIs:\s*(\S+)\s*\nSuites:\s*([^\n]+)", text, re.M):
            if any(s in {SUITE, "trixie", "stable", "sid"} for s in suites.split()) and "security" not in uri:
                return str(uri).rstrip("/")
        for uri, suite in re.findall(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+(\S+)", text, re.M):
            if "debian" in uri and "security" not in uri and suite.split("-")[0] in {SUITE, "trixie", "stable"}:
                return str(uri).rstrip("/")
    return "http://deb.debian.org/debian"


def apt_env() -> dict[str, str]:
    return {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}


def apt(*args: str, log: Path) -> None:
    """apt-get with one `apt-get update` and a retry when the package lists are missing or stale."""
    cmd = ["apt-get", "-o", "APT::Sandbox::User=root", *args]
    if run(cmd, log=log, check=False, env=apt_env()).returncode != 0:
        run(["apt-get", "update"], log=log, env=apt_env())
        run(cmd, log=log, env=apt_env())


def compose_version() -> tuple[int, int] | None:
    if shutil.which("docker") is None:
        return None
    result = run(["docker", "compose", "version", "--short"], check=False)
    match = re.match(r"v?(\d+)\.(\d+)", result.stdout.strip()) if result.returncode == 0 else None
    return (int(match.group(1)), int(match.group(2))) if match else None


def trixie_debs(packages: list[str], log: Path) -> list[Path]:
    """Download packages from Debian trixie with a private apt configuration (the system's is untouched)."""
    apt_dir = CACHE / "apt-trixie"
    debs_dir = CACHE / "debs"
    wanted = {p: sorted(debs_dir.glob(f"{p}_*.deb")) for p in packages}
    if any(not found for found in wanted.values()):
        (apt_dir / "lists" / "partial").mkdir(parents=True, exist_ok=True)
        (apt_dir / "cache" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
        debs_dir.mkdir(parents=True, exist_ok=True)
        sources = apt_dir / "sources.list"
        sources.write_text(f"deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] {debian_mirror()} "
                           "trixie main\n")
        options = ["-o", f"Dir::Etc::SourceList={sources}", "-o", "Dir::Etc::SourceParts=/dev/null",
                   "-o", f"Dir::State::Lists={apt_dir / 'lists'}", "-o", f"Dir::Cache={apt_dir / 'cache'}",
                   "-o", "APT::Sandbox::User=root"]
        run(["apt-get", *options, "update"], log=log, env=apt_env())
        run(["apt-get", *options, "download", *[p for p, found in wanted.items() if not found]], log=log,
            env=apt_env(), cwd=debs_dir)
        wanted = {p: sorted(debs_dir.glob(f"{p}_*.deb")) for p in packages}
    return [found[-1] for found in wanted.values()]


def ensure_tools() -> str:
    log = LOGS / "tools.log"
    done = []
    apt_packages = [pkg for cmd, pkg in [("dockerd", "docker.io"), ("debootstrap", "debootstrap")]
                    if shutil.which(cmd) is None]
    trixie = []
    if shutil.which("docker") is None:
        apt_packages.append("docker.io")
    if (compose_version() or (0, 0)) < MIN_COMPOSE:
        trixie.append("docker-compose")
    if shutil.which("docker") is None or run(["docker", "buildx", "version"], check=False).returncode != 0:
        trixie.append("docker-buildx")
    if (apt_packages or trixie) and not is_root():
        raise StageError(f"missing: {', '.join(sorted(set(apt_packages)) + trixie)}; install them, or run as root "
                         "so that this installs them")
    if (apt_packages or trixie) and shutil.which("apt-get") is None:
        raise StageError(f"missing: {', '.join(sorted(set(apt_packages)) + trixie)}, and no apt-get to install them")
    if apt_packages:
        apt("install", "--yes", "--no-install-recommends", *sorted(set(apt_packages)), log=log)
        done += sorted(set(apt_packages))
    if trixie:
        run(["dpkg", "-i", *trixie_debs(trixie, log)], log=log)
        done += [f"{p} (trixie)" for p in trixie]
    version = compose_version()
    if version is None or version < MIN_COMPOSE:
        raise StageError(f"docker compose {version} is too old: {'.'.join(map(str, MIN_COMPOSE))} or newer needed")
    return f"installed {', '.join(done)}" if done else "all present"


# --- the engine -----------------------------------------------------------------------------------------

class Engine:
    """The docker engine the run uses: one already running, or a dockerd started (and later stopped) here."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None

    @staticmethod
    def answers() -> bool:
        if shutil.which("docker") is None:
            return False
        try:
            return run(["docker", "info", "--format", "{{.ServerVersion}}"], check=False, timeout=20).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def ensure(self) -> str:
        if self.answers():
            return "using the engine that was running (left running)"
        if not is_root():
            raise StageError("no docker engine answers, and only root can start one here: start dockerd, or "
                             "run as root")
        log = LOGS / "dockerd.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            # Its own session: a Ctrl-C in the terminal reaches this script, which stops it in order.
            self.process = subprocess.Popen(["dockerd"], stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 60
        while not self.answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise StageError(f"dockerd did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.5)
        return f"started dockerd (pid {self.process.pid}; log {log.relative_to(ROOT)})"

    def stop(self) -> str:
        process, self.process = self.process, None
        if process is None:
            return "engine left running (not started here)"
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # it stops its containers and its containerd first
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                return f"dockerd (pid {process.pid}) killed after 60 s"
        return f"dockerd (pid {process.pid}) stopped"


# --- inputs of the build --------------------------------------------------------------------------------

def image_exists(name: str) -> bool:
    return docker("image", "inspect", name, check=False).returncode == 0


def ensure_base_image() -> str:
    """BASE_IMAGE from a debootstrap tarball (made once, cached), standing in for python:3.11-slim-bookworm."""
    if image_exists(BASE_IMAGE):
        return f"{BASE_IMAGE} present"
    key = hashlib.sha256(" ".join([SUITE, *BASE_PACKAGES]).encode()).hexdigest()[:10]
    tarball = CACHE / f"base-{SUITE}-{key}.tar"
    made = "cached tarball"
    if not tarball.exists():
        if not is_root():
            raise StageError(f"{BASE_IMAGE} is missing and debootstrap needs root")
        rootfs = CACHE / f"rootfs-{SUITE}"
        shutil.rmtree(rootfs, ignore_errors=True)
        mirror = debian_mirror()
        run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", SUITE, rootfs, mirror],
            log=LOGS / "debootstrap.log", timeout=900)
        # As the official slim images: no package caches, lists or docs.
        for junk in ["var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man"]:
            for path in (rootfs / junk).glob("*"):
                if path.is_file() or path.is_symlink():
                    path.unlink()
                elif path.name != "partial":
                    shutil.rmtree(path)
        run(["tar", "-C", rootfs, "-cf", f"{tarball}.tmp", "."], timeout=300)
        Path(f"{tarball}.tmp").rename(tarball)
        shutil.rmtree(rootfs)
        made = f"debootstrap {SUITE} from {mirror}"
    run(["docker", "import",
         "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
         "--change", "ENV LANG=C.UTF-8",
         "--change", 'CMD ["python3"]',
         "--message", "make compose-test: stand-in for python:3.11-slim-bookworm (debootstrap --variant=minbase)",
         tarball, BASE_IMAGE], timeout=300)
    return f"{BASE_IMAGE} imported ({made})"


def ensure_standin_repo() -> str:
    run([sys.executable, "-m", "modelrepo.standin", STANDIN_REPO], timeout=300)
    for path in [STANDIN_REPO, *STANDIN_REPO.rglob("*")]:  # the containers' users are not root
        path.chmod(path.stat().st_mode | (0o555 if path.is_dir() else 0o444))
    return f"{STANDIN_REPO.relative_to(ROOT)}: {', '.join(sorted(p.name for p in STANDIN_REPO.iterdir()))}"


def platform_options() -> list[str]:
    """Wheels for the images (CPython 3.11, glibc 2.36 of bookworm), whatever Python or glibc runs this."""
    arch = platform.machine()
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(36, 16, -1)]
    tags += [f"manylinux2014_{arch}", f"manylinux2010_{arch}", f"manylinux1_{arch}"]
    return ["--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
            *[a for tag in tags for a in ("--platform", tag)]]


def ensure_wheelhouse(folder: Path, lock: Path) -> str:
    stamp = folder / ".requirements"
    wanted = lock.read_text()
    if stamp.is_file() and stamp.read_text() == wanted and any(folder.glob("*.whl")):
        return f"{folder.relative_to(ROOT)} cached"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--dest", folder,
         *platform_options(), "--require-hashes", "-r", lock], log=LOGS / "wheelhouse.log", timeout=900)
    stamp.write_text(wanted)
    size = sum(p.stat().st_size for p in folder.glob("*.whl")) / 1e6
    return f"{folder.relative_to(ROOT)} downloaded ({len(list(folder.glob('*.whl')))} wheels, {size:.0f} MB)"


def ensure_debs(folder: Path, packages: tuple[str, ...], why: str) -> list[str]:
    """Debian packages downloaded (not installed) into an image's build context; cached there."""
    missing = [p for p in packages if not sorted(folder.glob(f"{p}_*.deb"))]
    if missing:
        if shutil.which("apt-get") is None:
            raise StageError(f"{why} takes {', '.join(missing)} from Debian's packages: no apt-get here")
        folder.mkdir(parents=True, exist_ok=True)
        log = LOGS / f"{folder.name}.log"
        cmd = ["apt-get", "-o", "APT::Sandbox::User=root", "download", *missing]
        if run(cmd, log=log, check=False, cwd=folder).returncode != 0:
            run(["apt-get", "update"], log=log, env=apt_env())
            run(cmd, log=log, cwd=folder)
    return [f"{sorted(folder.glob(f'{p}_*.deb'))[-1].name} {'downloaded' if p in missing else 'cached'}"
            for p in packages]


def ensure_prometheus_deb() -> str:
    return "; ".join(ensure_debs(PROMETHEUS_CONTEXT, ("prometheus",), "the monitoring profile's image"))


def ensure_proxy_context() -> str:
    """The proxy image's build context: Debian's nginx and envsubst, and the official entrypoint's stand-in."""
    found = ensure_debs(PROXY_CONTEXT, PROXY_PACKAGES, "the proxy's image")
    shutil.copy(PROXY_ENTRYPOINT, PROXY_CONTEXT / PROXY_ENTRYPOINT.name)
    return "; ".join(found)


# --- the run --------------------------------------------------------------------------------------------

class Stages:
    def __init__(self, prefix: str = "compose-test") -> None:
        self.prefix = prefix  # what starts each line: make k8s-test runs these stages too
        self.started = time.monotonic()
        self.failed = False

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[list[str]]:
        """Print one line for the stage: ok or FAILED, its duration and what it did."""
        detail: list[str] = []
        start = time.monotonic()
        print(f"{self.prefix}: {name} ...", flush=True)
        try:
            yield detail
        except BaseException as e:
            self.failed = True
            print(f"\n{self.prefix}: {name:<12} FAILED {time.monotonic() - start:6.1f} s  "
                  f"{e if isinstance(e, StageError) else repr(e)}", flush=True)
            raise
        print(f"{self.prefix}: {name:<12} ok     {time.monotonic() - start:6.1f} s  {'; '.join(detail)}", flush=True)


def build_images(stages: Stages, engine: Engine, stack: Stack, only: list[str] | None = None) -> None:
    """The stages from `tools` to `build`: each input found in its cache or made, then `docker compose build` of
    every buildable service, or of those in `only` (make k8s-test builds the images its pods run)."""
    with stages.stage("tools") as d:
        d.append(ensure_tools())
    with stages.stage("engine") as d:
        d.append(engine.ensure())
    with stages.stage("base image") as d:
        d.append(ensure_base_image())
    with stages.stage("stand-in") as d:
        d.append(ensure_standin_repo())
    with stages.stage("wheelhouses") as d:
        d.append(ensure_wheelhouse(SHIM_WHEELHOUSE, SHIM_LOCK))
        d.append(ensure_wheelhouse(TRITON_WHEELHOUSE, TRITON_LOCK))
    if only is None or "prometheus" in only:
        with stages.stage("prometheus") as d:
            d.append(ensure_prometheus_deb())
    if only is None or "proxy" in only:
        with stages.stage("proxy") as d:
            d.append(ensure_proxy_context())
    with stages.stage("build") as d:
        built = stack.build(only)
        d.append(f"{', '.join(built)} (log {(LOGS / 'build.log').relative_to(ROOT)})")


def run_suite(folder: str, flag: str, logs: Path, *options: str) -> None:
    """pytest on `folder` with `flag`=1 in its environment (the suite's own switch); StageError naming `logs`."""
    tests = subprocess.run([sys.executable, "-m", "pytest", folder, "-v", "-p", "no:cacheprovider", "--tb=short",
                            "--durations=0", *options], cwd=ROOT, env={**os.environ, flag: "1"}, check=False)
    if tests.returncode != 0:
        raise StageError(f"pytest {folder} failed (exit {tests.returncode}); the logs: {logs.relative_to(ROOT)}")


def shm_entries() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.iterdir()} if shm.is_dir() else set()


def sigterm_to_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # runs the `finally` below: the stack and the engine are stopped


def main() -> int:
    signal.signal(signal.SIGTERM, sigterm_to_exit)
    stages, engine, stack = Stages(), Engine(), Stack()
    shm_before = shm_entries()
    for old in LOGS.glob("*.log"):
        old.unlink()

    def body() -> None:
        with stages.stage("ports") as d:
            d.append(check_ports())
        build_images(stages, engine, stack)
        with stages.stage("stack") as d:
            skipped = ", ".join(f"{name} ({why})" for name, why in NOT_IN_CI.items())
            d.append(f"services {', '.join(stack.services())}; not run here: {skipped}")
            run_suite("tests/compose", "COMPOSE_STACK", LOGS / "stack.log")

    return run_stages(stages, body, lambda: cleanup(stages, engine, stack, shm_before))


def run_stages(stages: Stages, body: Callable[[], None], cleanup: Callable[[], int]) -> int:
    """The exit code of a run: 0 when `body` ends, 1 when a stage failed (it said why) or this tool broke (its
    traceback), 130 on ^C, 128+N on signal N; `cleanup` runs in every case and a failed cleanup fails the run."""
    result = 1
    try:
        body()
        result = 0
    except StageError:
        pass
    except KeyboardInterrupt:
        result = 130
    except SystemExit as e:
        result = int(e.code or 1)
    except Exception:  # a bug here, not in the stack: its traceback, and the cleanup all the same
        traceback.print_exc()
    finally:
        result = cleanup() or result
    print(f"{stages.prefix}: {'PASSED' if result == 0 else 'FAILED'} in {time.monotonic() - stages.started:.0f} s",
          flush=True)
    return result


def remove_leftovers() -> dict[str, list[str]]:
    """Whatever of the project `down -v` left (or could not remove: a broken compose file), removed by label."""
    left = {kind: ids for kind, ids in Stack.leftovers().items() if ids}
    for kind, command in [("containers", ["rm", "--force", "--volumes"]), ("networks", ["network", "rm"]),
                          ("volumes", ["volume", "rm", "--force"])]:
        if left.get(kind):
            docker(*command, *left[kind], check=False, timeout=120)
    return left


def cleanup(stages: Stages, engine: Engine, stack: Stack, shm_before: set[str]) -> int:
    """Pass or fail: nothing of the project left, the engine stopped if started here. 1 if something was left."""
    try:
        with stages.stage("cleanup") as d:
            if Engine.answers():
                try:
                    stack.down()
                finally:
                    left = remove_leftovers()
                if left:
                    raise StageError(f"left behind by `down -v` (now removed by label): {left}")
                d.append(f"no container, network or volume of {PROJECT} left")
            d.append(engine.stop())
            new_shm = sorted(shm_entries() - shm_before)
            # The stack's containers have their own /dev/shm: new entries on the host are other processes'.
            d.append(f"/dev/shm on the host: {len(new_shm)} new entries of other processes ({', '.join(new_shm[:3])})"
                     if new_shm else "/dev/shm on the host: nothing new")
    except (StageError, subprocess.TimeoutExpired):
        engine.stop()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
