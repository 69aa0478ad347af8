"""System shared memory regions for the `shm` transports: files in /dev/shm that Triton maps by key.

Who owns a region is told by a lock, not by a host name or a pid (both change, or repeat, across
containers and pid namespaces). Each owner (a TritonBackend, in the worker process that uses it) holds an
exclusive flock on its own lock file in /dev/shm for its lifetime, and names its regions after it:

    shim_<owner>.lock              the owner's lock file (it holds the owner's pid and host, for people)
    shim_<owner>_<n>_<in|out>      its regions (the file /dev/shm/<name>; Triton's region name is the same)

The kernel releases a flock when its process dies, however it dies. So whoever can take an owner's lock
knows that owner is gone, and removes its regions: a worker sweeps before it makes its own, and gunicorn's
master after a worker exits (forget_dead_owners, from its child_exit hook). This works across containers
that share an IPC namespace (/dev/shm), whatever their host names and pid namespaces. Nothing here imports
tritonclient: registration goes through the Triton backend's client, the master's clean-up through
Triton's HTTP API with the standard library.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import mmap
import os
import re
import secrets
import socket
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

log = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")
PREFIX = "shim"
LOCK_SUFFIX = ".lock"
_OWNED = re.compile(rf"^{PREFIX}_([0-9a-f]{{12}})_")  # a region's name: its owner's token


@dataclass
class Region:
    """One mapped region: `name` is both the /dev/shm file and Triton's name for it."""

    name: str
    size: int
    _map: mmap.mmap = field(repr=False)

    @property
    def key(self) -> str:
        return "/" + self.name  # what shm_open (and Triton's registration) takes

    def array(self, dtype: Any, shape: tuple[int, ...]) -> npt.NDArray[Any]:
        """A numpy view of the region's first bytes: writing into it is writing into the region."""
        return np.ndarray(shape, dtype=dtype, buffer=self._map)

    def close(self) -> None:
        """Unmap it here and remove its file (Triton's own mapping, if any, lives until it unregisters it)."""
        with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with the process
            self._map.close()
        with contextlib.suppress(FileNotFoundError):
            (SHM_DIR / self.name).unlink()


class Owner:
    """The owner of a set of regions: a random token and the exclusive lock that says it is alive."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(6)
        self.prefix = f"{PREFIX}_{self.token}_"
        self.pid = os.getpid()
        path = _lock_path(self.token)
        staging = SHM_DIR / f".{PREFIX}_{self.token}.new"
        # Locked before it has its name: a sweeper never finds a live owner's lock file unlocked.
        self._fd: int | None = os.open(staging, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(self._fd, json.dumps({"pid": self.pid, "host": socket.gethostname()}).encode() + b"\n")
            os.rename(staging, path)
        except BaseException:
            os.close(self._fd)
            staging.unlink(missing_ok=True)
            raise

    def create(self, name: str, size: int, mode: int) -> Region:
        """A fresh region `<prefix><name>` of `size` bytes."""
        return create(self.prefix + name, size, mode)

    def release(self) -> None:
        """The owner is done (its regions are removed already): its lock file goes, then its lock."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            _lock_path(self.token).unlink()
        os.close(self._fd)
        self._fd = None


def _lock_path(token: str) -> Path:
    return SHM_DIR / f"{PREFIX}_{token}{LOCK_SUFFIX}"


def create(name: str, size: int, mode: int) -> Region:
    """A fresh region of `size` bytes; a leftover file of the same name is replaced."""
    path = SHM_DIR / name
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.fchmod(fd, mode)  # not subject to the umask: Triton may run as another user (docker compose)
        os.ftruncate(fd, size)
        mapped = mmap.mmap(fd, size)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return Region(name, size, mapped)


def owner_of(name: str) -> str | None:
    """The owner token in a region's name, or None for a name that is not the shim's."""
    match = _OWNED.match(name)
    return match.group(1) if match else None


def _gone(token: str, *, missing_is_gone: bool) -> bool:
    """Is this owner gone? Its lock file can be locked (the kernel released a dead owner's lock), or it is
    missing (only where this /dev/shm is the one the regions were made in: `missing_is_gone`)."""
    try:
        fd = os.open(_lock_path(token), os.O_RDWR)
    except FileNotFoundError:
        return missing_is_gone
    except OSError:
        return False  # not ours to judge (permissions): leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # held: alive
    finally:
        os.close(fd)  # releases the lock if this took it
    return True


def stale_names(names: list[str], *, missing_is_gone: bool) -> list[str]:
    """Those of `names` (regions, in /dev/shm or in Triton's registry) whose owner is gone."""
    verdict: dict[str, bool] = {}
    found = []
    for name in names:
        token = owner_of(name)
        if token is None:
            continue
        if token not in verdict:
            verdict[token] = _gone(token, missing_is_gone=missing_is_gone)
        if verdict[token]:
            found.append(name)
    return found


def dead_owners() -> set[str]:
    """The owners whose lock file is in this /dev/shm and can be taken: they are gone."""
    return {token for token in owners() if _gone(token, missing_is_gone=False)}


def sweep_files() -> list[str]:
    """Remove the /dev/shm files (regions and lock files) of owners that are gone; return the regions' names."""
    dead = dead_owners()
    try:
        regions = [p.name for p in SHM_DIR.iterdir()
                   if p.name.startswith(PREFIX + "_") and not p.name.endswith(LOCK_SUFFIX)]
    except OSError:
        return []
    # A region's lock file lives in the /dev/shm the region does: none here means its owner is gone too.
    removed = [n for n in regions if owner_of(n) in dead] + stale_names(
        [n for n in regions if owner_of(n) not in dead], missing_is_gone=True)
    for name in removed:
        with contextlib.suppress(FileNotFoundError):
            (SHM_DIR / name).unlink()
    for token in dead:
        with contextlib.suppress(FileNotFoundError):
            _lock_path(token).unlink()
    return removed


def owners() -> dict[str, dict[str, Any]]:
    """Every owner's lock file in /dev/shm: {token: {"pid": ..., "host": ...}} (for people and tests)."""
    found: dict[str, dict[str, Any]] = {}
    for path in SHM_DIR.glob(f"{PREFIX}_*{LOCK_SUFFIX}"):
        token = path.name[len(PREFIX) + 1:-len(LOCK_SUFFIX)]
        if not re.fullmatch(r"[0-9a-f]{12}", token):
            continue
        try:
            found[token] = json.loads(path.read_text())
        except (OSError, ValueError):
            found[token] = {}
    return found


def forget_dead_owners(triton_url: str, headers: Mapping[str, str] | None = None, timeout_s: float = 2.0) -> None:
    """gunicorn's master, after a worker died: remove the regions of owners that are gone, from Triton's
    registry and from /dev/shm (`headers`: the key of Triton's restricted shared memory API).

    Only owners whose lock file it finds here (and can take) are unregistered from Triton: a master whose
    /dev/shm is not Triton's must not judge other hosts' regions. Best effort with short timeouts: a
    Triton that is down has no registrations to keep anyway.
    """
    dead = dead_owners()
    if dead:
        base = f"http://{triton_url}/v2/systemsharedmemory"
        try:
            request = urllib.request.Request(base + "/status", headers=dict(headers or {}))
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                regions = json.loads(response.read() or b"[]")
            for region in regions:
                name = str(region.get("name", ""))
                if owner_of(name) in dead:
                    request = urllib.request.Request(f"{base}/region/{name}/unregister", data=b"", method="POST",
                                                     headers=dict(headers or {}))
                    urllib.request.urlopen(request, timeout=timeout_s).close()
        except (OSError, ValueError) as e:  # unreachable, refused (no key), or not the JSON we know
            log.info("could not unregister the shared memory of workers that are gone from Triton: %s", e)
    sweep_files()
